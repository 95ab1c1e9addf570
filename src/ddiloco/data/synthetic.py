"""A synthetic language whose entropy is known exactly, so eval loss is a gap to the optimum.

The language is a sparse random Markov chain of order k over V tokens. Its state is the
context c = (s_{t-k+1}, ..., s_t), encoded base V with the oldest token most significant,
so there are C = V^k states and the next state is (c * V + s_{t+1}) mod C. Each context has
``support`` (S) possible next tokens with Dirichlet(concentration) probabilities.

Unique stationary distribution: every context's support contains the *successor* token
(s_t + 1) mod V. Following successors from any state reaches the "ramp" cycle
(j, j+1, ..., j+k-1) mod V, which every state can therefore reach, so there is exactly
one closed communicating class and hence one stationary distribution pi (states outside
the class are transient and get pi = 0). pi is computed by power iteration on the lazy
chain (P + I) / 2, which has the same pi and is aperiodic, so the iteration converges.

Exact quantities, in nats:
  entropy_rate        sum_c pi(c) H(next | c)
  sequence_floor(T)   the minimum mean cross-entropy a model can reach on the T targets
                      of a sample of T + 1 tokens started from pi (see the method).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ddiloco.data.stream import EVAL, TRAIN, check_learner, check_state, rng_for

__all__ = ["MarkovConfig", "MarkovLanguage", "SyntheticStream", "eval_batches"]

_MAX_STATES = 1 << 22
"""Largest V^order accepted: tables are (V^order, support) and pi has V^order entries."""
_MIN_PROB = 1e-9
"""Floor on next-token probabilities, so the successor link is never exactly zero."""


@dataclass(kw_only=True, slots=True)
class MarkovConfig:
    """Shape and seed of a :class:`MarkovLanguage`."""

    vocab_size: int = 64
    """V: number of tokens; must be >= 2."""
    order: int = 2
    """k: number of previous tokens the next token depends on; >= 1."""
    support: int = 4
    """S: number of possible next tokens per context, in [1, V]."""
    concentration: float = 1.0
    """Dirichlet concentration of the next-token probabilities; smaller is peakier
    (lower entropy), larger is closer to uniform over the support."""
    seed: int = 0
    """Seed of the language itself (which tokens follow which, with what probability)."""

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"MarkovConfig.vocab_size must be >= 2, got {self.vocab_size}")
        if self.order < 1:
            raise ValueError(f"MarkovConfig.order must be >= 1, got {self.order}")
        if not 1 <= self.support <= self.vocab_size:
            raise ValueError(
                f"MarkovConfig.support must be in [1, vocab_size={self.vocab_size}],"
                f" got {self.support}"
            )
        if not self.concentration > 0:
            raise ValueError(f"MarkovConfig.concentration must be > 0, got {self.concentration}")
        if self.vocab_size**self.order > _MAX_STATES:
            raise ValueError(
                f"vocab_size**order = {self.vocab_size**self.order} contexts is "
                f"more than {_MAX_STATES}; lower vocab_size or order"
            )
        if self.seed < 0:
            raise ValueError(f"MarkovConfig.seed must be >= 0, got {self.seed}")


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats along ``axis``; 0 log 0 = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log(p), 0.0)
    return terms.sum(axis=axis)


class MarkovLanguage:
    """Sparse random order-k Markov chain over V tokens with exact entropy figures.

    Attributes: ``next_tokens`` (C, S) int64, the support of each context (column 0 is
    the successor token); ``next_probs`` (C, S) float64; ``stationary`` (C,) pi.
    """

    def __init__(self, cfg: MarkovConfig | None = None) -> None:
        self.cfg = cfg = cfg if cfg is not None else MarkovConfig()
        V, k, S = cfg.vocab_size, cfg.order, cfg.support
        self.n_states = C = V**k
        rng = rng_for(cfg.seed, 2)  # domain 2: structure of the language, apart from data
        last = np.arange(C) % V  # most recent token of each context
        successor = (last + 1) % V
        # The other S - 1 tokens: a random subset of the V - 1 non-successors, drawn by
        # ranking random keys (vectorised sampling without replacement).
        keys = rng.random((C, V))
        keys[np.arange(C), successor] = np.inf
        others = np.argsort(keys, axis=1)[:, : S - 1]
        self.next_tokens = np.concatenate([successor[:, None], others], axis=1).astype(np.int64)
        probs = rng.dirichlet(np.full(S, cfg.concentration), size=C)
        probs = np.maximum(probs, _MIN_PROB)
        self.next_probs = probs / probs.sum(axis=1, keepdims=True)
        self._cum_probs = np.cumsum(self.next_probs, axis=1)
        self._cum_probs[:, -1] = 1.0  # guard against rounding: u < 1 always finds a slot
        self.stationary = self._stationary()
        self._cum_stationary = np.cumsum(self.stationary)
        self._cum_stationary[-1] = 1.0
        self.conditional_entropy = _entropy(self.next_probs)
        """H(next | c) for every context c, nats."""

    def _transitions(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """P as (rows, cols, probs), row-major: P[c, (c * V + x) mod C] = p(x | c)."""
        V, C, S = self.cfg.vocab_size, self.n_states, self.cfg.support
        rows = np.repeat(np.arange(C), S)
        cols = ((np.arange(C)[:, None] * V + self.next_tokens) % C).ravel()
        return rows, cols, self.next_probs.ravel()

    def step_distribution(self, pi: np.ndarray) -> np.ndarray:
        """pi P: the state distribution one step after ``pi``."""
        rows, cols, probs = self._transitions()
        return np.bincount(cols, weights=probs * pi[rows], minlength=self.n_states)

    def _stationary(self, tol: float = 1e-13, max_iter: int = 100_000) -> np.ndarray:
        rows, cols, probs = self._transitions()
        pi = np.full(self.n_states, 1.0 / self.n_states)
        for _ in range(max_iter):
            step = np.bincount(cols, weights=probs * pi[rows], minlength=self.n_states)
            new = 0.5 * (pi + step)  # lazy chain: same pi, aperiodic
            new /= new.sum()
            if np.abs(new - pi).sum() < tol:
                return new
            pi = new
        raise RuntimeError(
            f"stationary distribution did not converge in {max_iter} "
            f"iterations; raise MarkovConfig.concentration (very small "
            f"probabilities make the chain mix slowly)"
        )

    @property
    def entropy_rate(self) -> float:
        """H = sum_c pi(c) H(next | c): the best achievable loss per token, nats, once a
        model sees at least k tokens of context."""
        return float(self.stationary @ self.conditional_entropy)

    def prefix_conditional_entropies(self) -> np.ndarray:
        """h_j = H(s_j | s_0..s_{j-1}) under stationarity for j = 0..k-1 (h_0 = H(s_0))."""
        V, k = self.cfg.vocab_size, self.cfg.order
        joint = self.stationary.reshape((V,) * k)  # pi is the joint law of (s_0..s_{k-1})
        joint_entropy = [0.0]
        for j in range(1, k + 1):
            marginal = joint.sum(axis=tuple(range(j, k))) if j < k else joint
            joint_entropy.append(float(_entropy(marginal.ravel())))
        return np.diff(np.array(joint_entropy))

    def sequence_floor(self, T: int) -> float:
        """Minimum achievable mean cross-entropy (nats) over the T next-token targets of a
        sequence s_0..s_T started from stationarity, i.e. the best loss a causal model can
        reach on ``(x, y) = (s[:, :T], s[:, 1:])`` from :meth:`sample`.

        Target t (predicting s_{t+1} from s_0..s_t) costs h_{t+1} = H(s_{t+1} | s_0..s_t):
        exact prefix entropies for t + 1 < k (less context than the order), the entropy
        rate afterwards. Equal to ``entropy_rate`` for k = 1, above it for k >= 2, and it
        tends to it as T grows.
        """
        if T < 1:
            raise ValueError(f"T must be >= 1, got {T}")
        k = self.cfg.order
        h = self.prefix_conditional_entropies()  # h_0..h_{k-1}
        early = h[1 : min(k, T + 1)]  # targets t = 0..min(k-1, T)-1
        return float((early.sum() + (T - len(early)) * self.entropy_rate) / T)

    def sample(self, n: int, T: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` sequences of ``T + 1`` tokens, int64 (n, T + 1), each started from pi.

        Vectorised over sequences; the loop runs over positions only.
        """
        if n < 0 or T < 0:
            raise ValueError(f"n and T must be >= 0, got n={n}, T={T}")
        V, k, C = self.cfg.vocab_size, self.cfg.order, self.n_states
        out = np.empty((n, T + 1), dtype=np.int64)
        state = np.searchsorted(self._cum_stationary, rng.random(n), side="right")
        state = np.minimum(state, C - 1)
        digits = state.copy()
        for j in range(k - 1, -1, -1):  # the first k tokens are the digits of the state
            if j <= T:
                out[:, j] = digits % V
            digits //= V
        u = rng.random((max(T + 1 - k, 0), n))
        for t in range(k, T + 1):
            cum = self._cum_probs[state]  # (n, S)
            slot = (u[t - k][:, None] >= cum).sum(axis=1)
            token = self.next_tokens[state, slot]
            out[:, t] = token
            state = (state * V + token) % C
        return out

    def log_prob(self, seqs: np.ndarray) -> np.ndarray:
        """log p(s_t | s_0..s_{t-1}) for t = 1..T of sequences (n, T + 1) started from pi,
        as an (n, T) array; -mean of it estimates ``sequence_floor(T)``."""
        seqs = np.asarray(seqs, dtype=np.int64)
        n, L = seqs.shape
        V, k, C = self.cfg.vocab_size, self.cfg.order, self.n_states
        out = np.empty((n, max(L - 1, 0)))
        joint = self.stationary.reshape((V,) * k)
        marginals = [
            joint.sum(axis=tuple(range(j, k))) if j < k else joint for j in range(1, k + 1)
        ]  # marginals[j-1]: law of (s_0..s_{j-1})
        for t in range(1, min(k, L)):
            num = marginals[t][tuple(seqs[:, i] for i in range(t + 1))]
            den = marginals[t - 1][tuple(seqs[:, i] for i in range(t))]
            out[:, t - 1] = np.log(num / den)
        state = np.zeros(n, dtype=np.int64)
        for i in range(min(k, L)):
            state = state * V + seqs[:, i]
        for t in range(k, L):
            match = self.next_tokens[state] == seqs[:, t, None]
            p = (self.next_probs[state] * match).sum(axis=1)
            with np.errstate(divide="ignore"):
                out[:, t - 1] = np.log(p)
            state = (state * V + seqs[:, t]) % C
        return out


class SyntheticStream:
    """Learner ``m``'s deterministic stream of training batches from a MarkovLanguage.

    Batches are generated ``chunk_batches`` at a time; chunk j of learner m uses the
    random stream keyed (seed, TRAIN, m, j), so learners never share random numbers with
    each other or with :func:`eval_batches`, and any position can be resumed by
    regenerating one chunk. ``n_learners`` only validates ``learner``: a learner's stream
    does not depend on how many peers it has.
    """

    def __init__(
        self,
        lang: MarkovLanguage,
        *,
        learner: int,
        n_learners: int,
        batch_size: int,
        block_size: int,
        seed: int = 0,
        chunk_batches: int | None = None,
    ) -> None:
        check_learner(learner, n_learners)
        if batch_size < 1 or block_size < 1:
            raise ValueError(
                f"batch_size and block_size must be >= 1, got "
                f"batch_size={batch_size}, block_size={block_size}"
            )
        self.lang = lang
        self.learner, self.n_learners = learner, n_learners
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        # ~256k tokens per chunk: large enough to amortise the per-position loop.
        self.chunk_batches = chunk_batches or max(1, (1 << 18) // (batch_size * block_size))
        self._position = 0
        self._chunk_index = -1
        self._chunk: np.ndarray | None = None

    @property
    def position(self) -> int:
        """Number of batches consumed."""
        return self._position

    def _load_chunk(self, j: int) -> None:
        rng = rng_for(self.seed, TRAIN, self.learner, j)
        n = self.chunk_batches * self.batch_size
        self._chunk = self.lang.sample(n, self.block_size, rng)
        self._chunk_index = j

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each LongTensor [batch_size, block_size], with y = x shifted by one."""
        j, i = divmod(self._position, self.chunk_batches)
        if j != self._chunk_index:
            self._load_chunk(j)
        assert self._chunk is not None
        rows = self._chunk[i * self.batch_size : (i + 1) * self.batch_size]
        self._position += 1
        seq = torch.from_numpy(rows)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "synthetic",
            "position": self._position,
            "learner": self.learner,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "block_size": self.block_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._position = check_state(
            state,
            {
                "kind": "synthetic",
                "learner": self.learner,
                "seed": self.seed,
                "batch_size": self.batch_size,
                "block_size": self.block_size,
            },
        )


def eval_batches(
    lang: MarkovLanguage, *, n_batches: int, batch_size: int, block_size: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed held-out set of ``n_batches`` (x, y) batches, drawn from the random stream
    keyed (seed, EVAL), independent of every learner's training stream."""
    if n_batches < 1 or batch_size < 1 or block_size < 1:
        raise ValueError(
            f"n_batches, batch_size and block_size must be >= 1, got "
            f"{n_batches}, {batch_size}, {block_size}"
        )
    seqs = torch.from_numpy(lang.sample(n_batches * batch_size, block_size, rng_for(seed, EVAL)))
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in seqs.split(batch_size)]
