"""Token sampling: the settings as a dataclass, and a Sampler built once from them.

The chain follows llama.cpp's default order: penalties, top-k, top-p, min-p, temperature,
then a draw from the seeded generator. temperature <= 0 means greedy (argmax).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop."""

    temperature: float = 0.8
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off; divides positive logits of recent tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64  # how many recent tokens the penalties look at
    seed: int | None = None  # None: a fresh random seed
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (not emitted)
    ignore_eos: bool = False  # end-of-generation tokens are never drawn (llama.cpp's flag)
    logprobs: int | None = None  # None: off; n: each token's log-probability and the n best

    @classmethod
    def greedy(cls, **overrides) -> SamplingParams:
        return cls(temperature=0.0, **overrides)


MAX_CANDIDATES = 64  # the largest top-k that the backend selects for the sampler


@dataclass(frozen=True)
class Candidates:
    """The most likely next tokens, best first, as the backend selected them (on the GPU:
    only these come back from the device instead of the whole row of logits)."""

    ids: np.ndarray  # int32 [k]
    logits: np.ndarray  # float32 [k]


class Sampler:
    """Picks token ids from logits; owns the random generator, so the same seed gives the
    same tokens."""

    def __init__(self, params: SamplingParams, banned: frozenset[int] = frozenset()):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.banned = np.array(sorted(banned), np.int64)  # ids never drawn (ignore_eos)
        self._banned = frozenset(banned)
        self.candidates = self._candidates()

    @property
    def _penalized(self) -> bool:
        p = self.params
        return p.repeat_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)

    def _candidates(self) -> int:
        """How many of the most likely tokens the sampler needs (Candidates); 0: it needs
        the whole row of logits (penalties, log-probabilities, or top-k off or above
        MAX_CANDIDATES). Banned ids may take places among them, so they count too."""
        p = self.params
        if self._penalized or p.logprobs is not None:
            return 0
        k = 1 if p.temperature <= 0 else p.top_k
        k += len(self.banned)
        return k if 0 < k <= MAX_CANDIDATES and (p.temperature <= 0 or p.top_k > 0) else 0

    @property
    def argmax_only(self) -> bool:
        """The pick is the most likely token of the logits alone (greedy; no penalties, banned
        ids or log-probabilities), so a backend may pick it and run it on without the host."""
        return self.params.temperature <= 0 and self.candidates == 1

    def __call__(self, logits: np.ndarray | Candidates, history: list[int]) -> int:
        ids, probs = self.distribution(logits, history)
        if self.params.temperature <= 0:
            return int(ids[0])
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def distribution(
        self, logits: np.ndarray | Candidates, history: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The distribution the sampler draws from, after every filter: (ids, probabilities
        float64), most likely first; greedy is one id of probability 1. Speculative decoding
        verifies drafts against exactly this distribution."""
        p = self.params
        if isinstance(logits, Candidates):  # already the top k, best first
            ids, values = logits.ids, logits.logits
            if p.temperature <= 0:
                return _certain(next(int(i) for i in ids if int(i) not in self._banned))
            if self._banned:
                keep = ~np.isin(ids, self.banned)
                ids, values = ids[keep], values[keep]
            return self._filtered(ids[: p.top_k], values[: p.top_k].astype(np.float64))
        logits = np.asarray(logits, np.float32).reshape(-1)
        if len(self.banned):
            logits = logits.copy()
            logits[self.banned[self.banned < logits.size]] = -np.inf
        if self._penalized:
            logits = self._penalize(
                logits.copy(), history[-p.repeat_last_n :] if p.repeat_last_n else []
            )
        if p.temperature <= 0:
            return _certain(int(np.argmax(logits)))
        ids = np.arange(logits.size)
        if 0 < p.top_k < logits.size:
            ids = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
        ids = ids[np.argsort(-logits[ids], kind="stable")]  # most likely first
        return self._filtered(ids, logits[ids].astype(np.float64))

    def _filtered(self, ids: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """top-p, min-p and temperature over the top-k ids, kept their logits (float64), best
        first: the ids left and their probabilities."""
        p = self.params
        if not np.isfinite(kept).all():
            ids, kept = _usable(ids, kept)  # NaN or inf from a damaged model
            if len(ids) == 1:
                return _certain(int(ids[0]))
        probs = np.exp(kept - kept[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, kept, probs = ids[:cut], kept[:cut], probs[:cut]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            ids, kept = ids[keep], kept[keep]
        scaled = (kept - kept[0]) / p.temperature
        probs = np.exp(scaled)
        probs /= probs.sum()
        return ids, probs

    def _penalize(self, logits: np.ndarray, recent: list[int]) -> np.ndarray:
        p = self.params
        for tid, count in Counter(recent).items():
            if p.repeat_penalty != 1.0:
                v = logits[tid]
                logits[tid] = v / p.repeat_penalty if v > 0 else v * p.repeat_penalty
            logits[tid] -= count * p.frequency_penalty + p.presence_penalty
        return logits


def _certain(token: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array([token], np.int64), np.ones(1)


def _usable(ids: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates a draw can use when some logits are not finite: the first +inf alone (it
    outweighs every other), else the finite ones; the first candidate if none is."""
    top = np.flatnonzero(np.isposinf(kept))
    if top.size:
        return ids[top[:1]], kept[top[:1]]
    finite = np.isfinite(kept)
    if not finite.any():
        return ids[:1], np.zeros(1)
    return ids[finite], kept[finite]
