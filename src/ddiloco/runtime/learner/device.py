"""Moving fragments between a learner's device and the host without stalling training.

On the CPU a snapshot is a plain copy and an install uses the received tensors as they
are. On a CUDA device:

- **snapshot** (fragment p leaves at step t): the training stream makes a device-side copy
  of the fragment (a few microseconds of device bandwidth), then a side stream copies that
  copy into *pinned* host buffers with ``non_blocking`` copies, ordered by a CUDA event.
  The training stream goes on at once; the sender thread waits for the copy's event
  before it encodes, so the host never waits on the training thread's behalf.
- **install** (the merged fragment arrives, to be installed at step t + tau): the receiver
  thread copies it into pinned memory and starts a ``non_blocking`` host-to-device copy on
  a second side stream. At the install step the training stream *waits on that copy's
  event* (a device-side dependency, no host synchronize) and mixes or overwrites.

The same ``DeviceCopier`` serves both devices, so learner code has one path; only the
placement and the streams differ. ``LearnerSync`` (pure) calls ``snapshot``; the hook's
receiver thread calls ``stage``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["DeviceCopier", "Ready", "learner_device"]

Ready = Callable[[], None]
"""Called before the tensors it guards are read (host side: snapshot buffers in the sender
thread; device side: staged fragments in the training thread)."""


class DeviceCopier:
    """Snapshots of fragments to host buffers, and received fragments staged on the device.

    ``device``: where the model's parameters live. For ``cuda`` devices the copies run on
    two side streams (device-to-host and host-to-device) and host buffers are pinned."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)

    @classmethod
    def for_params(cls, params: Sequence[torch.Tensor]) -> DeviceCopier:
        """The copier for a model whose parameters are ``params`` (all on one device)."""
        devices = {t.device for t in params}
        if len(devices) != 1:
            raise ValueError(
                f"DecoupledLearner needs the model on one device; its parameters "
                f"are on {sorted(str(d) for d in devices)}"
            )
        return cls(devices.pop())

    def host_buffers(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 host buffers shaped as ``like`` (pinned for a CUDA device)."""
        return [torch.empty(t.shape, dtype=torch.float32, pin_memory=self.cuda) for t in like]

    def snapshot(
        self, src: Sequence[torch.Tensor], bufs: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], Ready | None]:
        """Copy ``src`` (device tensors) into fp32 host buffers (``bufs`` if given, else new
        ones). Returns the buffers and, on CUDA, a ``ready`` to call before reading them."""
        if bufs is None:
            bufs = self.host_buffers(src)
        with torch.no_grad():
            if not self.cuda:
                for b, t in zip(bufs, src):
                    b.copy_(t.detach())
                return bufs, None
            train = torch.cuda.current_stream(self.device)
            # the device-side copy is ordered on the training stream, before the optimizer
            # writes the parameters again; the slow device-to-host copy reads only the copy
            frozen = [t.detach().clone() for t in src]
            taken = torch.cuda.Event()
            taken.record(train)
            with torch.cuda.stream(self._d2h):
                self._d2h.wait_event(taken)
                for b, f in zip(bufs, frozen):
                    b.copy_(f, non_blocking=True)
                    f.record_stream(self._d2h)  # not reused before the copy has read it
                done = torch.cuda.Event()
                done.record(self._d2h)
        return bufs, done.synchronize

    def stage(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Ready | None]:
        """Start moving received host tensors to the device (any thread). Returns the device
        tensors and, on CUDA, a ``ready`` that the training thread calls before using them:
        it makes the training stream wait for the copy, without a host synchronize."""
        if not self.cuda:
            return list(tensors), None
        # pinned (page-locked) memory makes the copy truly asynchronous; torch's caching host
        # allocator keeps each pinned block until the copy that reads it has finished
        pinned = [t if t.is_pinned() else t.pin_memory() for t in tensors]
        with torch.cuda.stream(self._h2d):
            out = [t.to(self.device, non_blocking=True) for t in pinned]
            copied = torch.cuda.Event()
            copied.record(self._h2d)

        def ready() -> None:
            train = torch.cuda.current_stream(self.device)
            train.wait_event(copied)
            for t in out:
                t.record_stream(train)  # allocated on the side stream, used on this one

        return out, ready


def learner_device(
    requested: str = "auto", local_rank: int = 0, exclusive: bool = False
) -> torch.device:
    """The device of a learner process (one rank of an island): ``auto`` is
    ``cuda:LOCAL_RANK`` where CUDA is available, else the CPU; ``cuda`` requires it. With
    more ranks than GPUs on a node, ranks share them round-robin, unless ``exclusive`` (an
    NCCL island: one GPU per rank)."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {requested!r}")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for but torch sees no CUDA device "
            "(torch.cuda.is_available() is False); use device 'auto' or 'cpu'"
        )
    n = torch.cuda.device_count()
    if exclusive and local_rank >= n:
        raise ValueError(
            f"LOCAL_RANK {local_rank} has no GPU of its own ({n} visible) and an "
            f"NCCL island needs one GPU per rank: start at most {n} ranks per "
            f"node, or set DDILOCO_ISLAND_BACKEND=gloo to share GPUs"
        )
    return torch.device("cuda", local_rank % n)
