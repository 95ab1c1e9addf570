"""How a fragment's round becomes its next version: the pushes read one tensor at a time,
the merge guard, folding pushes into their round, and the outer step.

``FragmentState`` is fragment p's state on the syncer: the global tensors Theta_p, the
outer momentum, the version, its open round, the pushes carried to the round after it,
the published versions it keeps (``FragmentHistory``) and the merge guard's recent norms.

A round's merge, in steps (``SyncerState._merge`` runs them):

1. ``round_weights``: each push's weight ``tokens * staleness_discount ** (V - v)`` and
   the round's scale (k / n of the live learners with ``scale_partial``, times the
   round's mean discount);
2. ``guard_round``: the merge guard's factor per push (``norm_clip``; a folded round's
   pushes were measured as they were folded, the rest are folded now);
3. ``outer_step``: tensor by tensor, the merged outer gradient Delta_p and the Nesterov
   step (``merge.OuterNesterov``), or the final round's average; it stops at the first
   non-finite tensor.

Everything here runs on one fragment and is pure arithmetic on its tensors: no locks,
no clocks (the caller decides when it runs, and which lock it releases meanwhile).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ddiloco.algorithm import kernels
from ddiloco.algorithm.fragments import Fragmentation
from ddiloco.algorithm.history import FragmentHistory
from ddiloco.algorithm.merge import (
    NORM_WINDOW,
    Fold,
    OuterNesterov,
    all_finite,
    clip_bound,
    clip_factor,
    fold_for,
    merge_tensor,
    token_weight,
)
from ddiloco.algorithm.payload import CHUNK, EncodedParams
from ddiloco.algorithm.rounds import Contribution, Round
from ddiloco.algorithm.slices import SlicedParams
from ddiloco.algorithm.syncer_config import SyncerConfig

__all__ = [
    "FragmentState",
    "Step",
    "round_weights",
    "guard_round",
    "outer_step",
    "fold_push",
    "fold_pushes",
    "measure",
    "Measured",
    "peers_of",
    "open_folds",
    "validate",
    "distance",
    "nbytes",
    "as_f32",
]


@dataclass(slots=True)
class FragmentState:
    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    history: FragmentHistory
    version: int = 0
    round: Round = field(default_factory=Round)
    merging: bool = False  # its merge arithmetic is running (outside the caller's lock)
    norms: deque = field(default_factory=lambda: deque(maxlen=NORM_WINDOW))
    """Norms of the last merged outer gradients (the merge guard's statistic)."""
    carry: dict[int, Contribution] = field(default_factory=dict)
    """Pushes of learners whose earlier push of this fragment is already folded into a round
    (a folded push cannot be taken out again): each enters the round after that one, as a
    push arriving during a merge does."""


@dataclass(slots=True)
class Step:
    """``outer_step``'s result: the new tensors (up to the first non-finite one)."""

    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    steps: list[bytearray]
    """Each tensor's step, encoded for the history (with ``history`` > 0)."""
    finite: bool
    norms: list[float]
    """The pushes' outer gradient norms (with ``norm_clip`` > 0), in push order."""
    factors: list[float]
    """The merge guard's factor of each push (1.0: not clipped)."""


# -- reading pushes, one tensor at a time ---------------------------------------------
def reference(s: FragmentState, version: int, j: int) -> torch.Tensor:
    """Tensor j of the fragment at ``version`` (the current tensor itself, or rebuilt)."""
    if version == s.version:
        return s.theta[j]
    return s.history.tensor(s.theta, version, j)


def anchor(cfg: SyncerConfig, s: FragmentState, c: Contribution, j: int) -> torch.Tensor:
    """Tensor j of the fragment c's outer gradient is taken from (``anchor``)."""
    if cfg.anchor == "current":
        return s.theta[j]
    return reference(s, c.base_version, j)


def pushed(s: FragmentState, c: Contribution, j: int) -> torch.Tensor:
    """Tensor j of theta_{m,p} as pushed (a delta push added to its base version)."""
    if isinstance(c.params, SlicedParams):  # a sharded island's pieces, some deltas
        return c.params.pushed(j, lambda: reference(s, c.base_version, j))
    x = c.params[j]
    if getattr(c.params, "delta", False):
        return reference(s, c.base_version, j).add(x)
    return x


@dataclass(slots=True)
class Measured:
    """A push's outer-gradient norm, measured before it is folded (``measure``)."""

    norm: float
    """NaN while a tensor's norm is left to its fold (below)."""
    tensor_norms: list[float | None] | None
    """Each tensor's norm, for a push folded a piece at a time (None otherwise); an entry is
    None where the fold takes that tensor's norm in its own pass (``measure``'s
    ``deferred``)."""


def clipped(cfg: SyncerConfig, s: FragmentState, c: Contribution, j: int, f: float) -> torch.Tensor:
    """``pushed`` after the merge guard: ``anchor - f (anchor - theta)``."""
    x = pushed(s, c, j)
    if f >= 1.0:
        return x
    a = anchor(cfg, s, c, j)
    return torch.lerp(a, x.float(), f) if f > 0 else a.clone()


def push_norm(cfg: SyncerConfig, s: FragmentState, c: Contribution) -> float:
    """``|Delta_{m,p}|`` of push c over its fragment's tensors."""
    return math.sqrt(
        sum(distance([anchor(cfg, s, c, j)], [pushed(s, c, j)]) ** 2 for j in range(len(s.theta)))
    )


def guard_factor(
    cfg: SyncerConfig, s: FragmentState, norm: float, peers: Sequence[float] = ()
) -> float:
    """The merge guard's scale for an outer gradient of ``norm`` among the other pushes of
    its round of norms ``peers`` (``merge.clip_factor``)."""
    return clip_factor(norm, s.norms, cfg.norm_clip, peers)


def _by_pieces(c: Contribution) -> bool:
    """Whether push c is read a piece at a time (fp32, bf16 parameters, not delta-coded)."""
    return (
        isinstance(c.params, EncodedParams)
        and not c.params.delta
        and c.params.codec.element_bytes is not None
    )


def measure(
    cfg: SyncerConfig, s: FragmentState, c: Contribution, deferred: Sequence[bool] = ()
) -> Measured:
    """Push c's outer-gradient norm, before it is folded (the merge guard compares it with
    the other pushes of its round). A push read a piece at a time also keeps each tensor's
    norm, which its fold needs; the norm is 0.0 with the guard off, as it is recorded.

    ``deferred[j]``: tensor j's norm is left to its fold, which takes it in the same pass
    as the sum (``Fold.add_elements_measuring``), where the kernels read the push; the
    caller says where that is allowed (``fold_pushes``)."""
    if _by_pieces(c):
        assert isinstance(c.params, EncodedParams)
        scratch = np.empty(_CHUNK, dtype=np.float32)
        norms: list[float | None] = []
        for j, a in enumerate(_flat_anchors(cfg, s, c)):
            raw = c.params.elements(j)
            left = j < len(deferred) and deferred[j]
            if left and raw is not None and kernels.readable(a, raw[0]):
                norms.append(None)
            else:
                norms.append(_tensor_norm(a, c.params, j, raw, scratch))
        if None in norms:
            return Measured(math.nan, norms)  # completed by the fold
        return Measured(math.sqrt(sum(n * n for n in norms if n is not None)), norms)
    return Measured(push_norm(cfg, s, c) if cfg.norm_clip > 0 else 0.0, None)


def _tensor_norm(
    a: torch.Tensor,
    params: EncodedParams,
    j: int,
    raw: tuple[np.ndarray, bool] | None,
    scratch: np.ndarray,
) -> float:
    """``|a - x|`` of tensor j of ``params`` (x), as ``distance`` takes it of each of its
    pieces (``EncodedParams.chunks``): one pass of the kernels over its elements where they
    read them (``raw``), else decoded a piece at a time."""
    if raw is not None:
        got = kernels.diff_norm(a, raw[0], raw[1], CHUNK, scratch)
        if got is not None:
            return got[0]
    return math.sqrt(sum(distance([a[o : o + x.numel()]], [x]) ** 2 for o, x in params.chunks(j)))


def _flat_anchors(cfg: SyncerConfig, s: FragmentState, c: Contribution) -> list[torch.Tensor]:
    return [anchor(cfg, s, c, j).reshape(-1) for j in range(len(s.theta))]


def weight(cfg: SyncerConfig, s: FragmentState, c: Contribution) -> float:
    """A push's merge weight: its token weight times the staleness discount."""
    decay = cfg.staleness_discount ** max(0, s.version - c.base_version)
    return token_weight(c.c_tokens, c.c_steps) * decay


def validate(
    c: Contribution,
    fragmentation: Fragmentation,
    frags: Sequence[FragmentState],
    owned: set[int] | None,
    finite_checked: bool = False,
) -> str:
    """What is wrong with push c ("" when nothing): its fragment, counters, tensor count,
    shapes, dtypes and (unless ``finite_checked``) values."""
    if not 0 <= c.fragment < len(frags):
        return f"fragment {c.fragment} out of range [0, {len(frags)})"
    if c.c_steps < 1 or c.c_tokens < 1:
        return f"counters must be >= 1 (c_steps={c.c_steps}, c_tokens={c.c_tokens})"
    if owned is not None and c.fragment not in owned:
        return f"fragment {c.fragment} is held by another shard"
    theta = frags[c.fragment].theta
    names = fragmentation.fragments[c.fragment].names
    if len(c.params) != len(theta):
        return f"fragment {c.fragment} has {len(theta)} tensors, push has {len(c.params)}"
    if isinstance(c.params, (EncodedParams, SlicedParams)):  # fp32 when read, checked
        for j, (shape, ref) in enumerate(zip(c.params.shapes, theta)):
            if shape != tuple(ref.shape):
                return f"tensor {names[j]} has shape {tuple(ref.shape)}, push has {shape}"
        return ""
    for j, (x, ref) in enumerate(zip(c.params, theta)):
        if tuple(x.shape) != tuple(ref.shape):
            return f"tensor {names[j]} has shape {tuple(ref.shape)}, push has {tuple(x.shape)}"
        if not x.is_floating_point():
            return f"tensor {j} has dtype {x.dtype}; a floating dtype is required"
        if not finite_checked and not all_finite(x):
            return f"tensor {names[j]} has NaN/inf values"
    return ""


# -- folding pushes into their round --------------------------------------------------
def open_folds(cfg: SyncerConfig, s: FragmentState, embedding: Sequence[bool]) -> list[Fold]:
    """One empty ``Fold`` per tensor of the fragment (the merge rule has one: ``foldable``)."""
    folds = []
    for j, t in enumerate(s.theta):
        fold = fold_for(cfg.merge_rule, embedding[j], t.shape)
        if fold is None:  # SyncerState._fold checks the rule first
            raise AssertionError("merge rule has no fold")
        folds.append(fold)
    return folds


def fold_push(
    cfg: SyncerConfig,
    s: FragmentState,
    r: Round,
    c: Contribution,
    measured: Measured,
    peers: Sequence[float],
) -> tuple[float, float]:
    """Add push c's outer gradient, after the merge guard, to round r's folds; returns
    its norm and the guard's factor. The anchor, the guard's bound and the staleness
    discount are the ones its merge would use: the fragment does not change until its
    round merges (which waits for a fold in progress). ``measured`` is c's ``measure``,
    ``peers`` the norms of the other pushes of its round (``fold_pushes`` gives both)."""
    assert r.folds is not None
    if measured.tensor_norms is not None:
        return _fold_pieces(cfg, s, r, c, measured, peers)
    norm = measured.norm
    factor = guard_factor(cfg, s, norm, peers)
    w = weight(cfg, s, c)
    # an encoded push is read into new tensors that nobody else reads (the push is
    # consumed here): each becomes its outer gradient in place
    owned = isinstance(c.params, (EncodedParams, SlicedParams))
    for j, fold in enumerate(r.folds):
        x = pushed(s, c, j)
        if owned and x.dtype == torch.float32 and x.is_contiguous():
            v = torch.sub(anchor(cfg, s, c, j), x, out=x)
        else:
            v = torch.sub(anchor(cfg, s, c, j), x.float())
        del x
        if factor < 1.0:
            v.mul_(factor) if factor > 0 else v.zero_()
        with r.lock:
            fold.add(v, w)
    return norm, factor


def _fold_pieces(
    cfg: SyncerConfig,
    s: FragmentState,
    r: Round,
    c: Contribution,
    measured: Measured,
    peers: Sequence[float],
) -> tuple[float, float]:
    """``fold_push`` of a push whose tensors decode a piece at a time (fp32, bf16
    parameters), so that folding holds at most one piece of the push decoded, not a tensor.
    Each tensor is read twice, its norm (``measure``) and then the sum, since a radial
    fold's coefficient and the merge guard's factor need the norm before the first element
    is added; once where ``measure`` left its norm to the fold (a plain sum the guard
    cannot clip). Where the kernels read the push (fp32, bf16: ``kernels.elements``), each
    pass is one pass over its elements as they arrived; else it is decoded a piece at a
    time."""
    assert r.folds is not None and isinstance(c.params, EncodedParams)
    tensor_norms = measured.tensor_norms
    assert tensor_norms is not None
    left = None in tensor_norms
    norm = measured.norm
    factor = guard_factor(cfg, s, norm, peers)  # 1.0 where norms are left to the fold
    w = weight(cfg, s, c)
    scratch = np.empty(_CHUNK, dtype=np.float32) if left else None
    norms: list[float] = []
    for j, (fold, a) in enumerate(zip(r.folds, _flat_anchors(cfg, s, c))):
        raw = c.params.elements(j)
        n_j = tensor_norms[j]
        with r.lock:
            if n_j is None:  # a plain sum with the factor 1: its norm in the same pass
                assert scratch is not None
                got = None
                if raw is not None:
                    got = fold.add_elements_measuring(a, raw[0], raw[1], w, CHUNK, scratch)
                if got is None:  # the kernels were switched off since ``measure``
                    got = _tensor_norm(a, c.params, j, None, scratch)
                    fold.add_pieces(a, c.params.chunks(j), w, got, factor)
                n_j = got
            elif raw is None or not fold.add_elements(a, raw[0], raw[1], w, n_j, factor):
                fold.add_pieces(a, c.params.chunks(j), w, n_j, factor)
        norms.append(n_j)
    if left:  # the norms left to the fold are known now
        norm = measured.norm = math.sqrt(sum(n * n for n in norms))
        measured.tensor_norms = list(norms)
    return (norm if cfg.norm_clip > 0 else 0.0), factor


def fold_pushes(
    cfg: SyncerConfig, s: FragmentState, r: Round, todo: Sequence[Contribution]
) -> list[tuple[float, float]]:
    """``fold_push`` of each push of ``todo``, in order: every norm is measured first, so
    that the merge guard compares each push with all the pushes of its round known so far
    (``Round.norms``).

    While the guard cannot clip (off, or its fragment has too few recent norms:
    ``clip_bound`` is None; they do not change while the round is open) a tensor whose
    fold is a plain sum (not radial) needs no norm before its sum: its norm is taken in
    the same pass as its sum, and the push's norm enters ``Round.norms`` once it is folded
    (NaN until then, which ``clip_factor`` leaves out of the peers; no factor reads them
    meanwhile, since none can clip)."""
    assert r.folds is not None
    deferred: list[bool] = []
    if clip_bound(s.norms, cfg.norm_clip) is None:
        deferred = [not fold.radial for fold in r.folds]
    measured = [measure(cfg, s, c, deferred) for c in todo]
    r.norms.update({c.learner: x.norm for c, x in zip(todo, measured)})
    out = []
    for c, x in zip(todo, measured):
        left = x.tensor_norms is not None and None in x.tensor_norms
        out.append(fold_push(cfg, s, r, c, x, peers_of(r.norms, c.learner)))
        if left:  # its fold took the norms left to it
            r.norms[c.learner] = x.norm
    return out


def peers_of(norms: dict[int, float], learner: int) -> list[float]:
    """The norms of the other pushes of a round (the merge guard's ``peers``)."""
    return [n for m, n in norms.items() if m != learner]


# -- a round's merge, in steps --------------------------------------------------------
def round_weights(
    cfg: SyncerConfig, s: FragmentState, contribs: list[Contribution], n_live: int
) -> tuple[list[float], float]:
    """Step 1: the pushes' merge weights and the round's scale of the outer step, for a
    round of ``contribs`` among ``n_live`` live learners."""
    raw_w = [token_weight(c.c_tokens, c.c_steps) for c in contribs]
    weights = [weight(cfg, s, c) for c in contribs]
    n_live = max(len(contribs), n_live)
    scale = 1.0
    if cfg.scale_partial and len(contribs) < n_live:
        # a round merging some of the live learners takes that share of an outer step, so
        # that asynchronous single-learner merges add up to about one step per round
        scale = len(contribs) / n_live
    if cfg.staleness_discount < 1.0:
        # stale work also moves the model less: the step shrinks by the round's
        # token-weighted discount (a lone stale push is not renormalised back to 1)
        scale *= sum(weights) / sum(raw_w)
    return weights, scale


def guard_round(
    cfg: SyncerConfig, s: FragmentState, r: Round, contribs: list[Contribution]
) -> tuple[list[Fold] | None, list[float], list[float]]:
    """Step 2: the round's folds (taken from it; None: not folded), and the merge guard's
    norms and factors of its pushes. A folded round folds the pushes it has not folded
    yet."""
    k = cfg.norm_clip
    factors = [1.0] * len(contribs)
    norms: list[float] = []
    folds = None
    if r.folds is not None:  # a folded round: fold the rest, step from the folds
        rest = [c for c in contribs if c.learner not in r.folded]
        for c, guard in zip(rest, fold_pushes(cfg, s, r, rest)):
            r.folded[c.learner] = guard
        folds, r.folds = r.folds, None
        factors = [r.folded[c.learner][1] for c in contribs]
        if k > 0:
            norms = [r.folded[c.learner][0] for c in contribs]
    elif k > 0:  # the merge guard: clip an outer gradient far above the recent ones and
        # far above the other pushes of its round
        norms = [push_norm(cfg, s, c) for c in contribs]
        factors = [guard_factor(cfg, s, n, norms[:i] + norms[i + 1 :]) for i, n in enumerate(norms)]
    return folds, norms, factors


def outer_step(
    cfg: SyncerConfig,
    outer: OuterNesterov,
    s: FragmentState,
    r: Round,
    contribs: list[Contribution],
    weights: list[float],
    scale: float,
    embedding: Sequence[bool],
) -> Step:
    """Step 3: the new tensors of fragment s from round r's pushes ``contribs``, tensor by
    tensor: a fragment's pushes are read (decoded) one tensor at a time and the new tensors
    are built beside the published ones, which are never written (``Merged`` shares them),
    so a merge holds one tensor of each push. ``outer``: the outer optimizer of a regular
    round."""
    theta0, momentum0 = s.theta, s.momentum
    folds, norms, factors = guard_round(cfg, s, r, contribs)
    record = cfg.history > 0
    final = cfg.final_merge if all(c.final for c in contribs) else None
    all_final = final == "average"
    final_outer = outer
    if final == "sgd":  # the outer gradient's own step, no momentum
        final_outer = cfg.outer_optimizer(final)
    out = Step(theta=[], momentum=[], steps=[], finite=True, norms=norms, factors=factors)
    for j in range(len(theta0)):
        if folds is not None:
            g = folds[j].take()
            t, b, fin = outer.stepped_into(theta0[j], momentum0[j], g, scale)
            th, mo = [t], [b]
        elif all_final:
            t = _average([[clipped(cfg, s, c, j, f)] for c, f in zip(contribs, factors)], weights)[
                0
            ]
            th, mo, fin = [t], [momentum0[j]], all_finite(t)
        elif len(contribs) == 1:  # the merged outer gradient is the push's own
            c = contribs[0]
            th, mo, fin = final_outer.stepped_checked(
                [theta0[j]],
                [momentum0[j]],
                scale,
                anchors=[anchor(cfg, s, c, j)],
                pushes=[clipped(cfg, s, c, j, factors[0])],
            )
        else:
            deltas = _Deltas(cfg, s, j, contribs, factors)
            update = merge_tensor(deltas, weights, embedding[j], cfg.merge_rule)
            th, mo, fin = final_outer.stepped_checked(
                [theta0[j]], [momentum0[j]], scale, grads=[update]
            )
        out.finite = out.finite and fin
        if not out.finite:
            break
        out.theta += th
        out.momentum += mo
        if record:
            out.steps.append(s.history.encode_step(theta0[j], th[0]))
    return out


class _Deltas(Sequence[torch.Tensor]):
    """Tensor j of each push's outer gradient ``anchor - theta_{m,p}`` (after the merge
    guard), computed when the merge rule reads it: the rule reads each once, in order."""

    def __init__(self, cfg: SyncerConfig, s: FragmentState, j: int, contribs, factors) -> None:
        self._cfg, self._s, self._j, self._c, self._f = cfg, s, j, contribs, factors

    def __len__(self) -> int:
        return len(self._c)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        c, f = self._c[i], self._f[i]
        a = anchor(self._cfg, self._s, c, self._j)
        return a - clipped(self._cfg, self._s, c, self._j, f).float()


def _average(pushed: Sequence[Sequence[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    """Token-weighted average of the pushed parameters, tensor by tensor (new tensors)."""
    total = sum(weights)
    out = [torch.zeros_like(t, dtype=torch.float32) for t in pushed[0]]
    for ps, w in zip(pushed, weights):
        torch._foreach_add_(out, [x.float() for x in ps], alpha=w / total)
    return out


# -- sizes and norms ------------------------------------------------------------------
def nbytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes a push holds: its encoded bytes, or its tensors'."""
    nb = getattr(params, "nbytes", None)
    if isinstance(nb, int):
        return nb
    return sum(t.numel() * t.element_size() for t in params)


def as_f32(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """An fp32 copy of ``t``, or (``copy=False``) ``t`` itself where it is a contiguous fp32
    CPU tensor."""
    t = t.detach()
    if not copy and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.float().contiguous().clone()


_CHUNK = kernels.NORM_CHUNK


def distance(anchors: Sequence[torch.Tensor], pushes: Sequence[torch.Tensor]) -> float:
    """``||Delta_{m,p}|| = ||Theta_p - theta_{m,p}||`` over a fragment's tensors, without a
    fragment-sized temporary: chunk by chunk through a 128 KiB scratch buffer, in one thread
    (numpy). Measured per merge on a busy 2-core machine, this is several times faster than
    torch's multi-threaded subtract and norm, whose thread pool stalls when the cores are
    taken (``bench/merge_guard_cost.py``)."""
    scratch = np.empty(_CHUNK, dtype=np.float32)
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is an inf norm
        for a, x in zip(anchors, pushes):
            av = a.detach().float().reshape(-1).numpy()
            xv = x.detach().float().reshape(-1).numpy()
            for i in range(0, av.size, _CHUNK):
                d = scratch[: min(_CHUNK, av.size - i)]
                np.subtract(av[i : i + _CHUNK], xv[i : i + _CHUNK], out=d)
                total += float(np.dot(d, d))
    return math.sqrt(total)
