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

    @classmethod
    def greedy(cls, **overrides) -> SamplingParams:
        return cls(temperature=0.0, **overrides)


class Sampler:
    """Picks token ids from logits; owns the random generator, so the same seed gives the
    same tokens."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        p = self.params
        logits = np.asarray(logits, np.float32).reshape(-1)
        if p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            logits = self._penalize(
                logits.copy(), history[-p.repeat_last_n :] if p.repeat_last_n else []
            )
        if p.temperature <= 0:
            return int(np.argmax(logits))
        ids = np.arange(logits.size)
        if 0 < p.top_k < logits.size:
            ids = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
        ids = ids[np.argsort(-logits[ids], kind="stable")]  # most likely first
        kept = logits[ids].astype(np.float64)
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
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def _penalize(self, logits: np.ndarray, recent: list[int]) -> np.ndarray:
        p = self.params
        for tid, count in Counter(recent).items():
            if p.repeat_penalty != 1.0:
                v = logits[tid]
                logits[tid] = v / p.repeat_penalty if v > 0 else v * p.repeat_penalty
            logits[tid] -= count * p.frequency_penalty + p.presence_penalty
        return logits
