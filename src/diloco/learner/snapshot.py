"""Copies of a fragment's parameters to the host, taken without stopping the training thread.

To send fragment p the learner needs θ_p on the host (its delta is ``G_p − θ_p``). On CPU
that is a plain gather. On a CUDA device a plain gather would make the training thread wait
until the device has finished every kernel queued so far: a host sync in every step that
queues a fragment (one per step at P = H). ``HostCopies`` instead enqueues the copy on a side
stream into a pinned host buffer and returns at once; the learner checks
:meth:`HostCopy.ready` at later step boundaries (``torch.cuda.Event.query``, which does not
wait) and computes the delta when the copy has landed. The training stream waits for the
copy on the device before its next kernels, so the optimizer cannot change θ_p under it; the
host never waits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from diloco.algorithm.fragments import FragmentLayout


class HostCopy:
    """A fragment's values on their way to the host (fp32, flat)."""

    def __init__(self, value: torch.Tensor, event=None) -> None:
        self._value, self._event = value, event

    def ready(self) -> bool:
        """Whether :meth:`value` is available without waiting."""
        return self._event is None or self._event.query()

    def value(self) -> torch.Tensor:
        """The values (waits for the copy if it has not landed yet). A device copy's buffer
        is reused by the fragment's next copy: use it before taking another."""
        if self._event is not None:
            self._event.synchronize()
        return self._value

    def owned(self) -> torch.Tensor:
        """The values as a tensor the caller may keep and change (the gathered copy itself
        off the device; a copy of the pinned buffer on it)."""
        value = self.value()
        return value if self._event is None else value.clone()


class HostCopies:
    """Takes :class:`HostCopy` s of fragments of ``params`` (asynchronous on one CUDA device,
    immediate otherwise)."""

    def __init__(self, layout: FragmentLayout, params: Mapping[str, torch.Tensor]) -> None:
        self.layout, self.params = layout, params
        devices = {t.device for t in params.values()}
        self.device = devices.pop() if len(devices) == 1 else None
        self.asynchronous = self.device is not None and self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.asynchronous else None
        self._buffers: dict[int, torch.Tensor] = {}  # pinned, one per fragment, reused

    def take(self, p: int) -> HostCopy:
        if not self.asynchronous:
            return HostCopy(self.layout.gather(p, self.params))
        buffer = self._buffers.get(p)
        if buffer is None:
            numel = self.layout.fragments[p].numel
            buffer = torch.empty(numel, dtype=torch.float32, pin_memory=True)
            self._buffers[p] = buffer
        training = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(training)  # θ_p as of this step boundary
        with torch.cuda.stream(self._stream), torch.no_grad():
            for target, part in self.layout.pieces_of(p, buffer, self.params):
                part.copy_(target.to(torch.float32), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        training.wait_stream(self._stream)  # the next optimizer step waits for the copy
        return HostCopy(buffer, event)


@dataclass
class Snapshot:
    """What a queued fragment's delta is made of: θ_p's copy to the host, and ``G_p`` and
    the deltas on their way as they were when it was taken."""

    copy: HostCopy
    anchor: torch.Tensor
    on_its_way: torch.Tensor | None
    steps: int
    tokens: int
    local_step: int
    final: bool
