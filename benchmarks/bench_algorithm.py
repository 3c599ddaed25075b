"""Algorithm core benchmark: codec throughput and merge cost against a one-pass floor.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_algorithm.py [--values N]``).

* codecs: encode and decode a vector of N float32 values (default 25M) with each codec;
  reports milliseconds and GB/s of float32 input (median of ``--repeats`` runs); the decode
  into a new tensor (its pages zeroed by the kernel on first write) and into a buffer used
  before (``decode_reused_ms``: how the syncer's merge decodes one tensor's span of an
  upload, ``runtime.buffers``), and an upload kept as it arrived read a chunk at a time for
  its norm (``norm_chunked_ms``: ``EncodedDelta.norm``, the syncer's pass on arrival; its
  merge reads the sums' chunks the same way).
* merge: M = 2, 4, 8, 16 contributions for a 25M-parameter model cut into 24 fragments. The
  syncer's work per fragment is ``merge_contributions`` (RDA per tensor, weighted mean for
  embeddings) followed by one ``NesterovOuter.step``. The floor is one plain pass that reads
  every contribution once and accumulates it (``acc += w·Δ``, the cheapest possible merge).
  The ratio merge / floor is what the issue bounds (≤ 4× at M = 8).

All timings use one thread (``torch.set_num_threads(1)``), as the syncer does by default.
``--cpu-time`` times this process's CPU seconds (``time.process_time``) instead of wall
seconds: on a machine busy with other work they still say what the work itself costs (the
per-value costs ``diloco plan`` sizes syncer shards with, ``diloco.plan.syncer``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from diloco.algorithm import NesterovOuter, balanced_fragments, codecs, merge_contributions
from diloco.algorithm.encoded_delta import EncodedDelta
from diloco.runtime.buffers import BufferPool

CLOCK = time.perf_counter
"""What :func:`timed` reads: wall seconds, or CPU seconds with ``--cpu-time``."""


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` on :data:`CLOCK` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def bench_codecs(n: int, repeats: int) -> dict:
    x = torch.randn(n) * 1e-3
    out = {}
    for codec in codecs.CODECS:
        data = codecs.encode(x, codec)
        enc = timed(lambda codec=codec: codecs.encode(x, codec), repeats)
        dec = timed(lambda codec=codec, data=data: codecs.decode(data, (n,), codec), repeats)
        pool = BufferPool(keep=1)  # as the syncer decodes uploads: into a buffer used before
        again = timed(
            lambda codec=codec, data=data, pool=pool: codecs.decode(data, (n,), codec, pool.tensor),
            repeats,
        )
        kept = EncodedDelta([(codec, data)], n)  # as the syncer holds an upload
        chunked = timed(kept.norm, repeats)
        out[codec] = {
            "bytes_per_value": len(data) / n,
            "encode_ms": enc * 1e3,
            "decode_ms": dec * 1e3,
            "decode_reused_ms": again * 1e3,
            "norm_chunked_ms": chunked * 1e3,
            "encode_GBps": n * 4 / enc / 1e9,
            "decode_GBps": n * 4 / dec / 1e9,
        }
    return out


def model_25m() -> dict[str, torch.Tensor]:
    """Tensor shapes of a 25.7M-parameter GPT (6 layers, d=512, 12288-token vocabulary)."""
    d, vocab, layers = 512, 12288, 6
    named = {"tok_emb.weight": torch.empty(vocab, d), "pos_emb.weight": torch.empty(1024, d)}
    for i in range(layers):
        named[f"blocks.{i}.ln1.weight"] = torch.empty(d)
        named[f"blocks.{i}.attn.qkv.weight"] = torch.empty(3 * d, d)
        named[f"blocks.{i}.attn.proj.weight"] = torch.empty(d, d)
        named[f"blocks.{i}.ln2.weight"] = torch.empty(d)
        named[f"blocks.{i}.mlp.fc.weight"] = torch.empty(4 * d, d)
        named[f"blocks.{i}.mlp.proj.weight"] = torch.empty(d, 4 * d)
    named["ln_f.weight"] = torch.empty(d)
    return named


def bench_merge(counts: list[int], repeats: int, fragments: int = 24) -> dict:
    layout = balanced_fragments(model_25m(), fragments)
    gen = torch.Generator().manual_seed(0)
    out = {"params": layout.numel, "fragments": fragments}
    for m in counts:
        deltas = [
            [torch.randn(f.numel, generator=gen) * 1e-3 for _ in range(m)] for f in layout.fragments
        ]
        weights = [float(i + 1) for i in range(m)]
        params = [torch.zeros(f.numel) for f in layout.fragments]
        outer = NesterovOuter(lr=1.0, momentum=0.9)

        def merge(deltas=deltas, weights=weights, params=params, outer=outer):
            for p, frag in enumerate(layout.fragments):
                merged = merge_contributions(deltas[p], weights, frag)
                outer.step(p, params[p], merged)

        def floor(deltas=deltas, weights=weights):
            total = sum(weights)
            for per_fragment in deltas:
                acc = torch.zeros_like(per_fragment[0])
                for d, w in zip(per_fragment, weights, strict=True):
                    acc.add_(d, alpha=w / total)

        t_merge = timed(merge, repeats)
        t_floor = timed(floor, repeats)
        out[f"M={m}"] = {
            "merge_s": t_merge,
            "floor_s": t_floor,
            "ratio": t_merge / t_floor,
        }
        del deltas
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=25_000_000, help="codec vector length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--learners", default="2,4,8,16", help="comma-separated M values")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time CPU seconds of this process, not wall"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    result = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "clock": "cpu" if args.cpu_time else "wall",
        "codecs": bench_codecs(args.values, args.repeats),
        "merge": bench_merge([int(m) for m in args.learners.split(",")], args.repeats),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
