"""Learner-side bookkeeping of Decoupled DiLoCo, pure and transport-free.

``LearnerSync`` follows one learner's inner steps: it keeps the per-fragment counters
(c_steps, c_tokens since the fragment was last received), snapshots the fragments the
schedule says to send, and installs merged fragments at their install step
(send step + tau). It never waits: a merged fragment that arrives late is installed at the
first step boundary after it arrives.

Two install rules (``install``):

- ``overwrite`` (the paper's rule): theta_p <- alpha theta_p + (1 - alpha) Theta_p. The
  steps made on p between its push and the install (the tau overlap, and more when the
  merged value is late) are replaced.
- ``rebase``: theta_p <- theta_p + (1 - alpha) (Theta_p - theta_p(t)), where theta_p(t) is
  the snapshot of the learner's newest push that Theta_p merged. With alpha = 0 that is
  Theta_p plus the learner's own progress since that push. Nothing is replaced: the steps
  made since the push stay in the counters and go out with the next push of p. A merged
  value that holds none of the learner's pushes (its push was refused) is rebased on the
  oldest push still awaiting its install; the refused steps are counted dropped.

Drivers: the in-process engine (virtual clock) and the real learner process (a background
thread moves ``Outgoing`` to the syncer and feeds ``receive``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import torch

from ddiloco.algorithm.fragments import Fragmentation
from ddiloco.algorithm.merge import alpha_mix
from ddiloco.algorithm.schedule import FragmentSchedule

__all__ = [
    "DEFAULT_INSTALL",
    "DEFAULT_ALPHA",
    "INSTALL_RULES",
    "Outgoing",
    "LearnerSync",
    "StepLedger",
    "Snapshot",
    "host_snapshot",
]

INSTALL_RULES = ("overwrite", "rebase")
"""How a merged fragment is installed (see the module docstring)."""
DEFAULT_INSTALL: Final = "rebase"
"""The install rule of the run configuration and of ``DecoupledLearner`` (declared here
once: the configuration, the hook and ``LearnerSync`` read it)."""
DEFAULT_ALPHA: Final = 0.0
"""Install mixing alpha of the run configuration, ``DecoupledLearner`` and ``LearnerSync``
(0: the merged value, with no share of the learner's own fragment)."""


@dataclass(slots=True)
class Outgoing:
    """A fragment leaving the learner (the payload of a push)."""

    fragment: int
    params: list[torch.Tensor]
    """Snapshot of theta_{m,p} (fp32, CPU), one tensor per fragment tensor."""
    c_steps: int
    c_tokens: int
    base_version: int
    seq: int
    send_step: int
    covered_steps: int
    """Inner steps whose progress on this fragment this push is the first to carry."""
    ready: Callable[[], None] | None = None
    """Call before reading ``params`` when set (an asynchronous device-to-host copy)."""


Snapshot = Callable[
    [Sequence[torch.Tensor], "list[torch.Tensor] | None"],
    "tuple[list[torch.Tensor], Callable[[], None] | None]",
]
"""Copies a fragment's tensors into fp32 host buffers (the given ones, or new ones) and
returns them with an optional ``ready`` to call before reading them."""


def host_snapshot(
    src: Sequence[torch.Tensor], bufs: list[torch.Tensor] | None
) -> tuple[list[torch.Tensor], None]:
    """The synchronous ``Snapshot``: a plain copy into fp32 host buffers."""
    if bufs is None:
        bufs = [torch.empty(t.shape, dtype=torch.float32) for t in src]
    with torch.no_grad():
        for b, t in zip(bufs, src):
            b.copy_(t.detach())
    return bufs, None


@dataclass(slots=True)
class StepLedger:
    """Per-learner accounting of inner steps, in fragment-weighted step units.

    Each inner step is split over fragments by their byte share; a step's share of fragment p
    ends up merged (in a published version of the global model), dropped (stale push),
    overwritten (``install = overwrite`` only: made during the tau overlap, between sending p
    and installing its merged value, which replaces it), lost (the learner died before
    pushing it, or, with ``overwrite``, a merged value installed after its install step
    replaced it) or outstanding (not yet pushed/merged when the run ended). ``computed ==
    merged + dropped + overwritten + lost + pending + unpushed`` always holds. Only merged
    steps end up in the model: goodput counts them alone. With ``overwrite``, tau of the
    steps between two sends of a fragment are overwritten (at equal speeds, with installs on
    time, goodput is at most 1 - tau/H; with alpha mixing a share alpha of the overlap
    survives an install, and it is counted overwritten all the same). With ``rebase`` an
    install replaces nothing: the overlap steps stay unpushed and are merged with the next
    push."""

    computed: float = 0.0
    merged: float = 0.0
    dropped: float = 0.0
    overwritten: float = 0.0
    lost: float = 0.0
    pending: float = 0.0  # pushed, waiting for a merge
    unpushed: float = 0.0

    def balance_error(self) -> float:
        return abs(
            self.computed
            - (
                self.merged
                + self.dropped
                + self.overwritten
                + self.lost
                + self.pending
                + self.unpushed
            )
        )


@dataclass(slots=True)
class _Frag:
    c_steps: int = 0
    c_tokens: int = 0
    unpushed_steps: int = 0
    base_version: int = -1
    waiting: bool = False  # a push is out and its merged value not yet installed
    due_step: int = 0  # install not before this step
    sent_step: int = 0  # the step of the awaited push
    target_version: int | None = None  # install the first received version >= this
    received: tuple[int, list[torch.Tensor], Callable[[], None] | None] | None = None
    """The latest (version, params, ready) received."""
    in_flight: dict[int, int] = field(default_factory=dict)  # seq -> covered steps
    # install = rebase: the snapshots of the pushes sent since the last install, by seq
    anchors: dict[int, _Anchor] = field(default_factory=dict)
    targets: dict[int, int] = field(default_factory=dict)  # accepted seq -> its version


@dataclass(slots=True)
class _Anchor:
    """A push's snapshot, kept for a rebased install (``install = rebase``)."""

    params: list[torch.Tensor]
    ready: Callable[[], None] | None
    c_steps: int
    c_tokens: int
    released: bool = False  # the sender is done with the buffers


POOLED_SNAPSHOTS = 2
"""Released snapshot buffers a learner keeps for reuse, over all its fragments."""


class LearnerSync:
    """Counters, sends and installs for one learner."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        fragmentation: Fragmentation,
        schedule: FragmentSchedule,
        *,
        alpha: float = DEFAULT_ALPHA,
        install: str = DEFAULT_INSTALL,
        slot_s: float | None = None,
        snapshot: Snapshot = host_snapshot,
    ) -> None:
        """``slot_s``: None sends on the learner's own step count; a duration (the nominal
        step time) sends on elapsed time instead (``after_step(tokens, now_s)``), so that
        learners of different speeds send each fragment together. ``snapshot`` copies a
        fragment out at send time (asynchronously for a device, see
        ``ddiloco.runtime.learner.device``). ``install``: ``overwrite`` or ``rebase`` (the
        module docstring); ``rebase`` keeps each push's snapshot until its install (one
        fragment per push awaiting its install)."""
        if schedule.P != fragmentation.P:
            raise ValueError(
                f"schedule has P={schedule.P} but the fragmentation has {fragmentation.P}"
            )
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {alpha}")
        self.params = params
        self.fragmentation = fragmentation
        self.schedule = schedule
        self.alpha = alpha
        if install not in INSTALL_RULES:
            raise ValueError(f"install must be one of {INSTALL_RULES}, got {install!r}")
        self.install = install
        self.rebase = install == "rebase"
        self._anchor_lock = threading.Lock()  # ``release`` runs on the sender thread
        if slot_s is not None and not slot_s > 0:
            raise ValueError(f"slot_s must be > 0, got {slot_s}")
        self.slot_s = slot_s
        self.snapshot = snapshot
        self.last_s = 0.0
        self.step = 0
        self.seq = 0
        self.frags = [_Frag() for _ in range(fragmentation.P)]
        total = fragmentation.total_bytes
        self.share = [f.nbytes / total for f in fragmentation.fragments]
        self.ledger = StepLedger()
        self.installs = 0
        self.install_delay_steps = 0
        """Inner steps from each awaited push to its install, summed over ``installs``."""
        self._free: list[tuple[tuple, list[torch.Tensor]]] = []
        """Released snapshot buffers (their shapes, the buffers), oldest first, at most
        ``POOLED_SNAPSHOTS`` over all fragments."""

    def _tensors(self, p: int) -> list[torch.Tensor]:
        return [self.params[n] for n in self.fragmentation.fragments[p].names]

    # -- (re)start ------------------------------------------------------------------------
    def load_global(
        self,
        global_params: Mapping[str, torch.Tensor],
        versions: list[int],
        now_s: float | None = None,
    ) -> None:
        """Install the whole global model (start or rejoin); counters reset."""
        if now_s is not None:
            self.last_s = now_s
        with torch.no_grad():
            for p, f in enumerate(self.fragmentation.fragments):
                for n in f.names:
                    self.params[n].copy_(global_params[n])
                fr = self.frags[p]
                fr.c_steps = fr.c_tokens = 0
                fr.base_version = versions[p]
                fr.waiting = False
                fr.target_version = None
                fr.received = None
                self._drop_anchors(p, fr.anchors)
                fr.targets.clear()

    def fail(self) -> None:
        """The learner died: every step not yet pushed is lost; pushes in flight stay
        accounted as pending until the syncer's verdict arrives (``on_push_result``)."""
        for p, fr in enumerate(self.frags):
            self.ledger.unpushed -= fr.unpushed_steps * self.share[p]
            self.ledger.lost += fr.unpushed_steps * self.share[p]
            fr.unpushed_steps = 0

    # -- the step boundary -----------------------------------------------------------------
    def after_step(self, tokens: int, now_s: float | None = None) -> list[Outgoing]:
        """Record one inner step of ``tokens`` tokens; return the fragments to send now
        (``now_s`` is required with a time-driven schedule)."""
        self.step += 1
        self.ledger.computed += 1.0
        self.ledger.unpushed += 1.0
        for fr in self.frags:
            fr.c_steps += 1
            fr.c_tokens += tokens
            fr.unpushed_steps += 1
        if self.slot_s is None:
            due = self.schedule.fragments_to_send(self.step)
        else:
            if now_s is None:
                raise ValueError("a time-driven schedule needs after_step(tokens, now_s)")
            due = self.schedule.fragments_due(self.last_s / self.slot_s, now_s / self.slot_s)
            self.last_s = now_s
        # a learner that never installed a published version may not contribute
        return [self._send(p) for p in due if self.frags[p].base_version >= 0]

    def flush(self) -> list[Outgoing]:
        """Push every fragment holding progress not yet pushed (end of training)."""
        out = []
        for p, fr in enumerate(self.frags):
            if fr.unpushed_steps == 0 or fr.base_version < 0:
                continue
            out.append(self._send(p))
        return out

    def _send(self, p: int) -> Outgoing:
        fr = self.frags[p]
        self.seq += 1
        covered = fr.unpushed_steps
        fr.unpushed_steps = 0
        fr.in_flight[self.seq] = covered
        self.ledger.unpushed -= covered * self.share[p]
        self.ledger.pending += covered * self.share[p]
        snap, ready = self._snapshot(p)
        if self.rebase:
            with self._anchor_lock:
                fr.anchors[self.seq] = _Anchor(snap, ready, fr.c_steps, fr.c_tokens)
        if not fr.waiting:
            fr.waiting = True
            fr.due_step = self.schedule.install_step(self.step)
            fr.sent_step = self.step
            fr.target_version = None
        # else a push sent while an earlier one still awaits its install (a learner slower
        # than the fragment's period, or one back from a freeze): the earlier install
        # obligation stands, else every send would restart the wait and the learner would
        # never install again
        return Outgoing(
            fragment=p,
            params=snap,
            c_steps=fr.c_steps,
            c_tokens=fr.c_tokens,
            base_version=fr.base_version,
            seq=self.seq,
            send_step=self.step,
            covered_steps=covered,
            ready=ready,
        )

    def _snapshot(self, p: int) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
        """Copy fragment p into fp32 host buffers: released ones of the same shapes when
        there are some (the training thread then does one copy and no allocation), else new
        ones."""
        src = self._tensors(p)
        want = tuple(tuple(t.shape) for t in src)
        bufs = None
        with self._anchor_lock:
            for i, (shapes, _) in enumerate(self._free):
                if shapes == want:
                    bufs = self._free.pop(i)[1]
                    break
        return self.snapshot(src, bufs)

    def _pool(self, bufs: list[torch.Tensor]) -> None:
        """Keep released buffers for a later send (under ``_anchor_lock``). The pool is
        shared by the fragments, so it holds two fragments' buffers, not two per fragment (a
        model's worth or more); fragments of identical blocks share shapes and reuse them."""
        self._free.append((tuple(tuple(b.shape) for b in bufs), bufs))
        if len(self._free) > POOLED_SNAPSHOTS:
            del self._free[0]

    def release(self, p: int, params: list[torch.Tensor]) -> None:
        """Give back the snapshot of an ``Outgoing`` of fragment p once it is encoded, for
        a later send to reuse (any thread; optional: unreleased ones are freed). A snapshot
        kept for a rebased install is reused once that install is done."""
        with self._anchor_lock:
            for a in self.frags[p].anchors.values():
                if a.params is params:
                    a.released = True
                    return
            self._pool(params)

    def _drop_anchors(self, p: int, seqs: Iterable[int]) -> None:
        """Forget kept snapshots of fragment p; those the sender released are reused (the
        others are reused when the sender releases them)."""
        with self._anchor_lock:
            for seq in list(seqs):
                a = self.frags[p].anchors.pop(seq, None)
                if a is not None and a.released:
                    self._pool(a.params)

    def on_push_result(self, p: int, seq: int, accepted: bool, target_version: int = -1) -> None:
        """The syncer's verdict on a push: accepted into ``target_version``, or not."""
        fr = self.frags[p]
        covered = fr.in_flight.get(seq)
        if covered is None:
            return
        if accepted:
            fr.targets[seq] = target_version
            if fr.waiting and fr.target_version is None:
                # the first verdict of the awaited pushes sets the version to install (a
                # later push's, a later version, would move the install out of reach)
                fr.target_version = target_version
        else:
            del fr.in_flight[seq]
            self.ledger.pending -= covered * self.share[p]
            self.ledger.dropped += covered * self.share[p]
            fr.targets.pop(seq, None)
            if fr.waiting:  # nothing will contain our push: install the latest global we have
                fr.target_version = -1

    def receive(
        self,
        p: int,
        version: int,
        params: list[torch.Tensor],
        ready: Callable[[], None] | None = None,
    ) -> None:
        """A merged version of fragment p arrived (kept until its install step). ``ready``,
        when given, is called before ``params`` are used (a staged device copy)."""
        fr = self.frags[p]
        if fr.received is None or version > fr.received[0]:
            fr.received = (version, params, ready)

    def mark_merged(self, p: int, seq: int) -> None:
        """The push ``seq`` of fragment p is part of a published version (and with it every
        earlier push of p it superseded: counters and parameters are cumulative)."""
        fr = self.frags[p]
        for s in [s for s in fr.in_flight if s <= seq]:
            covered = fr.in_flight.pop(s)
            self.ledger.pending -= covered * self.share[p]
            self.ledger.merged += covered * self.share[p]

    def install_due(self) -> list[int]:
        """Install every fragment whose install step has come and whose awaited version has
        arrived. Returns the installed fragment indices."""
        done = []
        for p, fr in enumerate(self.frags):
            if not fr.waiting or self.step < fr.due_step or fr.received is None:
                continue
            version, params, ready = fr.received
            if fr.target_version is None or version < fr.target_version:
                if fr.target_version != -1 or version <= fr.base_version:
                    continue
            if ready is not None:
                ready()
            anchor = self._anchor_for(p, version) if self.rebase else None
            if anchor is None:
                self._overwrite(p, params)
            else:
                self._rebase(p, params, *anchor)
            fr.base_version = version
            fr.waiting = False
            fr.target_version = None
            fr.received = None
            self.installs += 1
            self.install_delay_steps += self.step - fr.sent_step
            done.append(p)
        return done

    @property
    def mean_install_delay_steps(self) -> float:
        """Mean inner steps from a push to the install of its merged value (tau when every
        merged value is on time)."""
        return self.install_delay_steps / self.installs if self.installs else 0.0

    def _overwrite(self, p: int, params: list[torch.Tensor]) -> None:
        """Install by alpha mixing; the progress made on p since its push is replaced: up to
        the install step it is the tau overlap (overwritten), after it a late install (lost)."""
        fr = self.frags[p]
        with torch.no_grad():
            for t, g in zip(self._tensors(p), params):
                alpha_mix(t, g.to(t.device, t.dtype), self.alpha)
        late = min(max(0, self.step - fr.due_step), fr.unpushed_steps)
        overlap = fr.unpushed_steps - late
        self.ledger.unpushed -= fr.unpushed_steps * self.share[p]
        self.ledger.lost += late * self.share[p]
        self.ledger.overwritten += overlap * self.share[p]
        fr.unpushed_steps = 0
        fr.c_steps = fr.c_tokens = 0
        if fr.anchors:
            self._drop_anchors(p, fr.anchors)
        fr.targets.clear()

    def _anchor_for(self, p: int, version: int) -> tuple[int, _Anchor] | None:
        """The kept push that ``version`` of p merged last (a push accepted into a version
        at most ``version``), else the oldest kept one (the merged value holds none of ours)."""
        fr = self.frags[p]
        if not fr.anchors:
            return None
        merged = [s for s in fr.anchors if fr.targets.get(s, version + 1) <= version]
        seq = max(merged) if merged else min(fr.anchors)
        return seq, fr.anchors[seq]

    def _rebase(self, p: int, params: list[torch.Tensor], seq: int, a: _Anchor) -> None:
        """theta_p <- theta_p + (1 - alpha) (Theta_p - snapshot): the global value plus this
        learner's progress since push ``seq``. The counters keep the steps since that push;
        nothing is overwritten or lost."""
        fr = self.frags[p]
        if a.ready is not None:
            a.ready()
        steps_since = fr.c_steps - a.c_steps
        with torch.no_grad():
            for t, g, snap in zip(self._tensors(p), params, a.params):
                if steps_since == 0:  # nothing to keep: exactly the overwrite
                    alpha_mix(t, g.to(t.device, t.dtype), self.alpha)
                else:  # a new tensor: ``g`` may be shared with other learners
                    d = torch.sub(g.to(t.device, torch.float32), snap.to(t.device))
                    t.add_(d.to(t.dtype), alpha=1.0 - self.alpha)
        fr.c_steps = steps_since
        fr.c_tokens -= a.c_tokens
        self._drop_anchors(p, [s for s in fr.anchors if s <= seq])
        for later in fr.anchors.values():  # pushes after ``seq``: counters from the new origin
            later.c_steps -= a.c_steps
            later.c_tokens -= a.c_tokens
        for s in [s for s in fr.targets if s <= seq]:
            del fr.targets[s]

    @property
    def waiting_fragments(self) -> list[int]:
        return [p for p, fr in enumerate(self.frags) if fr.waiting]
