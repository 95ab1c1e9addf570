"""Merging learners' fragments on the syncer: token weights, radial-directional
averaging (RDA), plain weighted averaging, the Nesterov outer step, and alpha mixing on
install.

Symbols: Theta_p global fragment, theta_{m,p} learner m's fragment,
Delta_{m,p} = Theta_p - theta_{m,p} its outer gradient,
w_{m,p} = c_tokens * (c_tokens / c_steps) its weight ("quantity x quality").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ddiloco.algorithm import kernels

__all__ = [
    "MERGE_RULES",
    "MergeRule",
    "merge_rule",
    "token_weight",
    "weighted_average",
    "rda",
    "merge_outer_gradients",
    "merge_tensor",
    "OuterNesterov",
    "alpha_mix",
    "all_finite",
    "all_finite_list",
    "NORM_WINDOW",
    "NORM_MIN_HISTORY",
    "clip_bound",
    "clip_factor",
    "Fold",
    "fold_for",
    "foldable",
]

MergeRule = Callable[[Sequence[torch.Tensor], Sequence[float], bool], torch.Tensor]
"""A merge rule: ``(outer gradients of one tensor, one per learner; their weights; whether
the tensor is an embedding) -> the merged outer gradient``."""

_RULES: dict[str, MergeRule] = {}
_FOLDS: dict[str, Callable[[bool], bool]] = {}


def merge_rule(
    name: str, *, radial: Callable[[bool], bool] | None = None
) -> Callable[[MergeRule], MergeRule]:
    """Register the decorated function as the merge rule ``name`` (``sync.merge_rule``).

    ``radial``, for a rule that is a weighted sum (the syncer then folds each push into its
    round as it arrives, ``Fold``): given whether a tensor is an embedding, whether the rule
    averages that tensor radial-directionally (``rda``) or plainly. A rule without it is
    applied to the round's pushes at its merge, which holds them until then."""

    def register(fn: MergeRule) -> MergeRule:
        if name in _RULES:
            raise ValueError(f"merge rule {name!r} is already registered")
        _RULES[name] = fn
        if radial is not None:
            _FOLDS[name] = radial
        return fn

    return register


def token_weight(c_tokens: int, c_steps: int) -> float:
    """``w = c_tokens * (c_tokens / c_steps)``: tokens seen times tokens per step."""
    if c_steps <= 0 or c_tokens <= 0:
        return 0.0
    return float(c_tokens) * (float(c_tokens) / float(c_steps))


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``. A sum is one fast vectorised pass and NaN/inf propagate into
    it; only when it is not finite (which finite values can also cause, by overflowing)
    does a min/max pass decide. ``torch.isfinite(t).all()`` is ~15x slower on CPU. A
    contiguous fp32 CPU tensor goes to the C kernel where it is built (``kernels``)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    fused = kernels.all_finite(t)
    if fused is not None:
        return fused
    if math.isfinite(float(t.sum())):
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def all_finite_list(ts: Sequence[torch.Tensor]) -> bool:
    """``all_finite`` of every tensor, in one fused call for floating tensors of one dtype
    (a multi-tensor norm, NaN/inf propagating into it), per tensor otherwise."""
    fl = [t for t in ts if t.numel() and t.is_floating_point()]
    if not fl:
        return True
    if len({(t.dtype, t.device) for t in fl}) == 1:
        norms = torch._foreach_norm(fl)
        if all(math.isfinite(float(n)) for n in norms):
            return True
    return all(all_finite(t) for t in fl)


NORM_WINDOW = 32
"""Merged outer gradients per fragment whose norms the merge guard's median is taken over."""
NORM_MIN_HISTORY = 8
"""Merged outer gradients a fragment needs before the merge guard acts."""


def clip_bound(recent: Sequence[float], k: float) -> float | None:
    """The merge guard's bound on an outer gradient's norm: ``k`` times the median of the
    ``recent`` norms merged for its fragment (a robust statistic: a minority of outliers
    among them barely moves it). None while there are fewer than ``NORM_MIN_HISTORY`` of
    them or the guard is off (``k == 0``)."""
    if k <= 0 or len(recent) < NORM_MIN_HISTORY:
        return None
    return k * statistics.median(recent)


def clip_factor(
    norm: float, recent: Sequence[float], k: float, peers: Sequence[float] = ()
) -> float:
    """The merge guard's scale for an outer gradient of ``norm``: its ``clip_bound`` over
    the norm (0 when the norm overflowed) when the norm is over that bound and also over
    ``k`` times the lower median of its ``peers``, the norms of the other pushes of its
    round; else 1.

    The peers tell a wild learner from shared progress: a push is clipped only when it is
    far above both its fragment's recent outer gradients and the other learners' in the
    same round. When a round's pushes all grow together (the learning rate's warm-up, the
    large first steps of a run) the recent median lags behind them; clipping such rounds
    cost 1.9 points of the gap to DP in a 600-step real-text run, 0.05 at 2,400 steps
    (docs/results/real_text.md). A lone
    push (K = 1) is judged by the recent norms alone, and the guard bounds a minority of
    wild learners in a round, not a majority."""
    bound = clip_bound(recent, k)
    if bound is None or not norm > bound:
        return 1.0
    others = [n for n in peers if not math.isnan(n)]
    if others and not norm > k * statistics.median_low(others):
        return 1.0
    return bound / norm


def _normalised(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    if not total > 0:
        raise ValueError("merge weights must have a positive sum")
    return [float(w) / total for w in weights]


def weighted_average(vs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i w_i v_i / sum_i w_i``. A single input is returned as it is (as fp32)."""
    ws = _normalised(weights)
    if len(vs) == 1:
        return vs[0].float()
    out = torch.zeros_like(vs[0], dtype=torch.float32)
    for w, v in zip(ws, vs, strict=True):
        out.add_(v.float(), alpha=w)
    return out


def rda(vs: Sequence[torch.Tensor], weights: Sequence[float], eps: float = 1e-12) -> torch.Tensor:
    """Radial-directional average: ``(sum w|v| / sum w) * unit(sum w unit(v))``.

    Norms and directions are averaged separately, so nearly orthogonal inputs of equal
    norm R give an output of norm R (plain averaging would give about R/sqrt(M)). A single
    input is its own radial-directional average and is returned as it is (as fp32).
    """
    ws = _normalised(weights)
    if len(vs) == 1:
        return vs[0].float()
    radius = 0.0
    direction = torch.zeros_like(vs[0], dtype=torch.float32)
    for w, v in zip(ws, vs, strict=True):
        v = v.float()
        n = float(torch.linalg.vector_norm(v))
        radius += w * n
        if n > eps:
            direction.add_(v, alpha=w / n)
    dn = float(torch.linalg.vector_norm(direction))
    if dn <= eps:  # all inputs zero, or directions cancel exactly: no update
        return torch.zeros_like(direction)
    return direction.mul_(radius / dn)


def merge_outer_gradients(
    deltas: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    embedding: Sequence[bool],
    rule: str = "rda",
) -> list[torch.Tensor]:
    """Merge per-learner outer gradients of one fragment, tensor by tensor, by the
    registered merge rule ``rule`` (``MERGE_RULES``).

    ``deltas[m][j]`` is learner m's outer gradient for the fragment's j-th tensor.
    """
    fn = _RULES.get(rule)
    if fn is None:
        raise ValueError(f"unknown merge rule {rule!r}; choose one of {tuple(_RULES)}")
    if not deltas:
        raise ValueError("nothing to merge")
    return [fn([d[j] for d in deltas], weights, is_emb) for j, is_emb in enumerate(embedding)]


def merge_tensor(
    vs: Sequence[torch.Tensor], weights: Sequence[float], embedding: bool, rule: str = "rda"
) -> torch.Tensor:
    """One tensor of ``merge_outer_gradients``: ``vs[m]`` is learner m's outer gradient of it.
    The rules read each of ``vs`` once, in order, so ``vs`` may compute them as it is read."""
    fn = _RULES.get(rule)
    if fn is None:
        raise ValueError(f"unknown merge rule {rule!r}; choose one of {tuple(_RULES)}")
    if not len(vs):
        raise ValueError("nothing to merge")
    return fn(vs, weights, embedding)


@merge_rule("rda", radial=lambda embedding: not embedding)
def _rda_rule(vs: Sequence[torch.Tensor], weights: Sequence[float], embedding: bool):
    """RDA for non-embedding tensors, the plain weighted average for embeddings."""
    return weighted_average(vs, weights) if embedding else rda(vs, weights)


@merge_rule("average", radial=lambda embedding: False)
def _average_rule(vs: Sequence[torch.Tensor], weights: Sequence[float], embedding: bool):
    """The plain token-weighted average for every tensor."""
    return weighted_average(vs, weights)


MERGE_RULES: tuple[str, ...] = tuple(_RULES)
"""The registered merge rules' names; a new rule is a function above with ``@merge_rule``."""

_EPS = 1e-12


class Fold:
    """A merge rule applied to one tensor's outer gradients one at a time, as they arrive,
    in one fp32 buffer: ``rda`` and ``average`` are weighted sums, so a round need not hold
    its pushes until it merges.

    radial (``rda``): ``D = sum_i w_i v_i / |v_i|``, ``R = sum_i w_i |v_i|``,
    ``W = sum_i w_i``; the merged gradient is ``D * R / (W |D|)``, which is ``rda``'s
    ``unit(sum w unit(v)) * sum w|v| / sum w``. Plain: ``sum_i w_i v_i / W``. Equal to the
    rules applied to the same inputs up to fp32 rounding (the sums are taken in arrival
    order, the weights are normalised at the end)."""

    __slots__ = ("radial", "shape", "sum", "radius", "weight")

    def __init__(self, shape: torch.Size | tuple[int, ...], radial: bool) -> None:
        self.radial = radial
        self.shape = tuple(shape)
        self.sum: torch.Tensor | None = None
        self.radius = 0.0
        self.weight = 0.0

    @property
    def nbytes(self) -> int:
        return 0 if self.sum is None else self.sum.numel() * 4

    def add(self, v: torch.Tensor, w: float) -> None:
        """Add one learner's outer gradient ``v`` (fp32) with weight ``w``. ``v`` is
        consumed: the first one becomes the buffer, so pass a tensor nobody else reads."""
        self.weight += w
        c = w
        if self.radial:
            n = float(torch.linalg.vector_norm(v))
            self.radius += w * n
            if not n > _EPS:
                return
            c = w / n
        if self.sum is None:
            self.sum = v.mul_(c)
        else:
            self.sum.add_(v, alpha=c)

    def add_pieces(
        self,
        anchor: torch.Tensor,
        pieces: Iterable[tuple[int, torch.Tensor]],
        w: float,
        norm: float,
        factor: float = 1.0,
    ) -> None:
        """``add(factor * (anchor - x), w)`` for an ``x`` given as (offset, flat values)
        pieces, whose ``norm = |anchor - x|`` the caller measured: the outer gradient is
        never built whole, only a piece at a time."""
        c = self._count(w, norm, factor)
        if c is None:
            return
        if self.sum is None:
            self.sum = torch.zeros(self.shape, dtype=torch.float32)
        out = self.sum.view(-1)
        flat = anchor.reshape(-1)
        for o, x in pieces:
            n = x.numel()
            out[o : o + n].add_(torch.sub(flat[o : o + n], x), alpha=c)

    def add_elements(
        self,
        anchor: torch.Tensor,
        x: np.ndarray,
        bf16: bool,
        w: float,
        norm: float,
        factor: float = 1.0,
    ) -> bool:
        """``add_pieces`` of a push's elements as they arrived (``kernels.elements``), in one
        pass that widens them in registers and rounds as ``add_pieces`` does; False (nothing
        added) where the kernels cannot run."""
        flat = anchor.reshape(-1)
        if not kernels.readable(flat, x):
            return False
        c = self._count(w, norm, factor)
        if c is not None:
            fresh = self.sum is None
            kernels.diff_fold(self._buffer(), flat, x, bf16, c, fresh=fresh)
        return True

    def add_elements_measuring(
        self,
        anchor: torch.Tensor,
        x: np.ndarray,
        bf16: bool,
        w: float,
        piece: int,
        scratch: np.ndarray,
    ) -> float | None:
        """``add_elements`` with the guard's factor 1 of a plain (not radial) sum, whose
        coefficient needs no norm: the norm ``|anchor - x|`` is taken in the same pass, as
        ``kernels.diff_norm`` takes it, and returned. None (nothing added) where the
        kernels cannot run."""
        if self.radial:
            raise ValueError("a radial fold needs the norm before the pass")
        flat = anchor.reshape(-1)
        if not kernels.readable(flat, x):
            return None
        fresh = self.sum is None
        got = kernels.diff_fold_norm(self._buffer(), flat, x, bf16, w, piece, scratch, fresh=fresh)
        assert got is not None
        self._count(w, got[0], 1.0)
        return got[0]

    def _count(self, w: float, norm: float, factor: float) -> float | None:
        """Count one push of weight ``w``, outer-gradient norm ``norm`` and guard factor
        ``factor``: the coefficient of its outer gradient in the sum, None when it adds
        nothing to it (a radial fold's zero gradient)."""
        self.weight += w
        if not self.radial:
            return w * factor
        self.radius += w * factor * norm
        if not factor * norm > _EPS:
            return None
        return w / norm  # the clip factor scales the radius, not the direction

    def _buffer(self) -> torch.Tensor:
        """The sum, flat; a new one is allocated but not zeroed (its first add writes it)."""
        if self.sum is None:
            self.sum = kernels.empty_f32(self.shape)
        return self.sum.view(-1)

    def take(self) -> torch.Tensor:
        """The merged outer gradient, in the fold's own buffer (the fold gives it up)."""
        if not self.weight > 0:
            raise ValueError("merge weights must have a positive sum")
        s, self.sum = self.sum, None
        if s is None:  # nothing but zero gradients
            return torch.zeros(self.shape, dtype=torch.float32)
        if not self.radial:
            return s.div_(self.weight)
        dn = float(torch.linalg.vector_norm(s))
        if not dn / self.weight > _EPS:  # the directions cancel exactly: no update
            return s.zero_()
        return s.mul_(self.radius / (self.weight * dn))


def foldable(rule: str) -> bool:
    """Merge rule ``rule`` is a weighted sum, which the syncer folds as pushes arrive."""
    return rule in _FOLDS


def fold_for(rule: str, embedding: bool, shape: torch.Size | tuple[int, ...]) -> Fold | None:
    """A ``Fold`` of one tensor for merge rule ``rule``, or None when the rule is not a
    weighted sum (its pushes are held until the merge)."""
    radial = _FOLDS.get(rule)
    return None if radial is None else Fold(shape, radial(embedding))


@dataclass(kw_only=True, slots=True)
class OuterNesterov:
    """SGD with Nesterov momentum on outer gradients, one state per fragment tensor.

    Same update as ``torch.optim.SGD(lr, momentum, nesterov=True)``:
    ``b <- mu*b + g``; ``theta <- theta - lr*(g + mu*b)``. Its defaults are the run's
    (``SyncerConfig`` and the configuration's ``sync.outer_lr``, ``sync.outer_momentum``
    read them), and every method builds it through ``SyncerConfig.outer_optimizer``.
    """

    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer lr must be > 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")

    def step(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
    ) -> None:
        """Update ``params`` and momentum ``buffers`` in place (buffers start at zero)."""
        for p, g, b in zip(params, grads, buffers, strict=True):
            if self.momentum > 0:
                b.mul_(self.momentum).add_(g)
                p.sub_(g.add(b, alpha=self.momentum), alpha=self.lr)
            else:
                p.sub_(g, alpha=self.lr)

    def stepped(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        scale: float = 1.0,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``step`` on ``scale * grads`` into new tensors, inputs untouched except ``grads``
        (reused as scratch), in multi-tensor calls: what a syncer publishes while the
        previous version may still be read. With ``scale == 1`` the operations (and so
        the rounding) are ``step``'s; otherwise the scale is folded into the coefficients
        (``b' = mu*b + s*g``, ``theta' = theta - lr*s*g - lr*mu*b'``: five passes per
        tensor where scaling first would take six)."""
        params, grads, buffers = list(params), list(grads), list(buffers)
        if self.momentum == 0:
            return torch._foreach_add(params, grads, alpha=-self.lr * scale), buffers
        new_b = torch._foreach_mul(buffers, self.momentum)
        if scale == 1.0:
            torch._foreach_add_(new_b, grads)  # mu*b + g
            torch._foreach_add_(grads, new_b, alpha=self.momentum)  # g + mu*b'
            return torch._foreach_add(params, grads, alpha=-self.lr), new_b
        torch._foreach_add_(new_b, grads, alpha=scale)
        new_p = torch._foreach_add(params, grads, alpha=-self.lr * scale)
        torch._foreach_add_(new_p, new_b, alpha=-self.lr * self.momentum)
        return new_p, new_b

    def stepped_into(
        self, param: torch.Tensor, buffer: torch.Tensor, grad: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``stepped`` of one tensor whose new momentum is written into ``grad``'s memory
        (a fold's buffer, given up): ``theta' = theta - lr*s*g - lr*mu*b'`` with
        ``b' = mu*b + s*g``. Allocates only the new parameter tensor (``stepped`` and the
        kernel allocate the new momentum too). Equal to ``stepped`` up to fp32 rounding.
        Returns (new parameter, new momentum, whether the new parameter is finite)."""
        new_p = torch.add(param, grad, alpha=-self.lr * scale)
        if self.momentum == 0:
            return new_p, buffer, all_finite(new_p)
        new_b = (grad.mul_(scale) if scale != 1.0 else grad).add_(buffer, alpha=self.momentum)
        new_p.add_(new_b, alpha=-self.lr * self.momentum)
        return new_p, new_b, all_finite(new_p)

    def stepped_checked(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        scale: float = 1.0,
        *,
        grads: Sequence[torch.Tensor] | None = None,
        anchors: Sequence[torch.Tensor] | None = None,
        pushes: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
        """``stepped`` on ``grads``, or on ``anchors - pushes``, and whether every new
        parameter is finite. Only ``grads`` may be written (scratch, as in ``stepped``).
        Where the C kernel runs (``kernels``: contiguous fp32 CPU tensors, momentum > 0)
        this is one pass per tensor; otherwise the multi-tensor operations of ``stepped``.
        The two agree up to fp32 rounding."""
        if (grads is None) == (anchors is None or pushes is None):
            raise ValueError("give either grads or both anchors and pushes")
        if self.momentum > 0:
            fused = kernels.nesterov_stepped(
                params,
                buffers,
                lr=self.lr,
                momentum=self.momentum,
                scale=scale,
                grads=grads,
                anchors=anchors,
                pushes=pushes,
            )
            if fused is not None:
                return fused
        if grads is None:
            grads = torch._foreach_sub(list(anchors), [x.float() for x in pushes])
        new_p, new_b = self.stepped(params, grads, buffers, scale)
        return new_p, new_b, all_finite_list(new_p)


def alpha_mix(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> None:
    """Install a merged fragment: ``local <- alpha*local + (1-alpha)*global`` in place.

    ``alpha = 0`` overwrites (the default); ``alpha > 0`` keeps part of the local progress
    made while the fragment was in flight (Streaming DiLoCo)."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha}")
    if alpha == 0.0:
        local.copy_(global_)
    else:
        local.mul_(alpha).add_(global_.to(local.dtype), alpha=1.0 - alpha)
