"""The int and sign codecs' encoders and decoders as they were before they were made faster,
written plainly: what ``tests/test_codecs_exact.py`` holds the fast ones to, byte for byte and
bit for bit (results and refusals). Only the pieces that changed; the layouts themselves are
``diloco.algorithm.codecs``'s module docstring."""

from __future__ import annotations

import numpy as np
import torch

from diloco.algorithm.codecs import BLOCK_SIZE, SIGN_BLOCKS, CodecError, NonFiniteError

LEVELS = {"int8": 127, "int4": 7, "int2": 1}
F32_MAX = float(torch.finfo(torch.float32).max)


def _finite(t: torch.Tensor) -> bool:
    return t.numel() == 0 or bool(torch.isfinite(t).all())


def encode_int(tensor: torch.Tensor, codec: str) -> bytes:
    """The int8/int4/int2 payload of ``tensor``."""
    src = tensor.detach().reshape(-1)
    n = src.numel()
    nb = -(-n // BLOCK_SIZE)
    buf = torch.empty(nb * BLOCK_SIZE, dtype=torch.float32)
    buf[:n].copy_(src)
    buf[n:].zero_()
    blocks = buf.view(nb, BLOCK_SIZE)
    lo, hi = torch.aminmax(blocks, dim=1)
    absmax = torch.maximum(hi, -lo)
    if not _finite(absmax):
        raise NonFiniteError(f"{codec}: tensor has non-finite values")
    levels = LEVELS[codec]
    scale = absmax / levels
    scale = torch.where(scale * levels > absmax, torch.nextafter(scale, torch.zeros(())), scale)
    denom = torch.where(absmax > 0, absmax, torch.ones(()))
    q = blocks.div_(denom[:, None]).mul_(levels).round_().to(torch.int8).view(-1)
    if codec == "int4":
        u = q.view(torch.uint8).view(-1, 2)
        q = ((u[:, 0] & 0x0F) | (u[:, 1] << 4))[: (n + 1) // 2]
    elif codec == "int2":
        u = q.view(torch.uint8).view(-1, 4)
        packed = (u[:, 0] & 0x03) | ((u[:, 1] & 0x03) << 2) | ((u[:, 2] & 0x03) << 4)
        q = (packed | (u[:, 3] << 6))[: (n + 3) // 4]
    else:
        q = q[:n]
    scales = scale.numpy().astype("<f4").view(np.uint8)
    return scales.tobytes() + q.numpy().view(np.uint8).tobytes()


def decode_int(data: bytes, n: int, codec: str) -> torch.Tensor:
    """The values of an int8/int4/int2 payload of ``n`` values (its length already checked)."""
    mv = memoryview(data).cast("B")
    levels = LEVELS[codec]
    nb = -(-n // BLOCK_SIZE)
    scale = torch.from_numpy(np.frombuffer(mv, dtype="<f4", count=nb).astype(np.float32))
    if not _finite(scale):
        raise NonFiniteError(f"{codec}: payload scales are not finite")
    if bool((scale < 0).any()) or bool((scale > F32_MAX / levels).any()):
        raise CodecError(f"{codec}: payload has a scale outside [0, float32 max / {levels}]")
    codes = torch.from_numpy(np.frombuffer(mv, dtype=np.int8, offset=4 * nb).copy())
    if codec == "int4":
        q = torch.empty((codes.numel(), 2), dtype=torch.int8)
        torch.bitwise_right_shift(torch.bitwise_left_shift(codes, 4), 4, out=q[:, 0])
        torch.bitwise_right_shift(codes, 4, out=q[:, 1])
        codes = q.view(-1)[:n]
    elif codec == "int2":
        q = torch.empty((codes.numel(), 4), dtype=torch.int8)
        for k in range(4):
            torch.bitwise_right_shift(torch.bitwise_left_shift(codes, 6 - 2 * k), 6, out=q[:, k])
        if bool(q.view(-1)[n:].any()):
            raise CodecError(f"{codec}: payload has set padding bits after the last value")
        codes = q.view(-1)[:n]
    if n and int(codes.min()) == -(levels + 1):
        raise CodecError(f"{codec}: payload holds the code -{levels + 1}, never produced")
    out = codes.to(torch.float32)
    full = (n // BLOCK_SIZE) * BLOCK_SIZE
    out[:full].view(-1, BLOCK_SIZE).mul_(scale[: full // BLOCK_SIZE, None])
    if full < n:
        out[full:].mul_(scale[-1])
    return out


SIGNS_OF_BYTE = torch.tensor([[-1.0 if b >> k & 1 else 1.0 for k in range(8)] for b in range(256)])


def decode_sign(data: bytes, n: int, codec: str) -> torch.Tensor:
    """The values of a sign1/sign1w payload of ``n`` values (its length already checked)."""
    mv = memoryview(data).cast("B")
    block = SIGN_BLOCKS[codec]
    nb = -(-n // block)
    scale = torch.from_numpy(np.frombuffer(mv, dtype="<f4", count=nb).astype(np.float32))
    if not _finite(scale):
        raise NonFiniteError(f"{codec}: payload scales are not finite")
    if bool((scale < 0).any()):
        raise CodecError(f"{codec}: payload has a negative scale")
    packed = np.frombuffer(mv, dtype=np.uint8, offset=4 * nb)
    if n % 8 and packed[-1] >> (n % 8):
        raise CodecError(f"{codec}: payload has set padding bits after the last value")
    whole = np.zeros(nb * block // 8, dtype=np.int64)
    whole[: packed.size] = packed
    out = SIGNS_OF_BYTE[torch.from_numpy(whole)].view(nb, block).mul_(scale[:, None])
    return out.view(-1)[:n]
