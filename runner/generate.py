"""Generation as a few small functions: prefill, decode step, and a streaming generator that
applies the sampler, end-of-generation tokens, stop strings and the token budget."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from fastrun.runner.kv_cache import KVCache
from fastrun.runner.sampling import Candidates, Sampler, SamplingParams


class Token(str):
    """A generated piece of text that also carries its token id (`.id`).

    The text can be empty while a multi-byte character is still incomplete.
    """

    id: int

    def __new__(cls, text: str, tid: int):
        obj = super().__new__(cls, text)
        obj.id = tid
        return obj


@dataclass
class Completion:
    """What one generation produced; filled in while its stream runs."""

    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually run (the rest came from the cache)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "interrupted"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prefill's logits
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds and n else 0.0


def _last(out) -> np.ndarray | Candidates:
    """The last token's logits, or its Candidates, from model.forward's result."""
    if isinstance(out, tuple):
        return Candidates(out[0][-1], out[1][-1])
    return out[-1]


def prefill(model, cache: KVCache, ids: list[int], top_k: int = 0):
    """Bring the cache to hold `ids`, reusing its longest common prefix; returns the logits
    after the last id (with top_k: its k most likely tokens, Candidates) and how many ids
    were run."""
    keep = min(cache.common_prefix(ids), len(ids) - 1)  # the last id always runs: its logits
    cache.trim(keep)
    return _last(model.forward(ids[keep:], cache, top_k=top_k)), len(ids) - keep


def decode_step(model, cache: KVCache, token: int, top_k: int = 0):
    """Run one token; returns the logits for the next (with top_k: Candidates)."""
    return _last(model.forward([token], cache, top_k=top_k))


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def stream(
    model,
    tokenizer,
    cache: KVCache,
    prompt_ids: list[int],
    params: SamplingParams,
    out: Completion,
) -> Iterator[Token]:
    """Generate from a prompt, yielding text pieces as they become final; fills `out`."""
    sampler = Sampler(params)
    eog = tokenizer.eog_ids
    decoder = tokenizer.stream_decoder()
    out.prompt_tokens = len(prompt_ids)
    t0 = time.perf_counter()
    top_k = sampler.candidates  # on the GPU only these come back from the device
    logits, out.prefilled_tokens = prefill(model, cache, prompt_ids, top_k)
    out.prefill_seconds = time.perf_counter() - t0
    pending = ""  # decoded text not yet emitted: it may be the start of a stop string
    t0 = time.perf_counter()
    try:
        while True:
            token = sampler(logits, cache.tokens)
            if token in eog:
                out.finish_reason = "stop"
                break
            out.tokens.append(token)
            pending += decoder.push(token)
            hit = min((i for i in (pending.find(s) for s in params.stop) if i >= 0), default=-1)
            if hit >= 0:
                out.text += pending[:hit]
                yield Token(pending[:hit], token)
                out.finish_reason = "stop"
                return
            ready = len(pending) - _held_back(pending, params.stop)
            out.text += pending[:ready]
            yield Token(pending[:ready], token)
            pending = pending[ready:]
            if len(out.tokens) >= params.max_tokens or cache.free_slots == 0:
                out.finish_reason = "length"
                break
            logits = decode_step(model, cache, token, top_k)
        pending += decoder.flush()
        if pending:
            out.text += pending
            yield Token(pending, out.tokens[-1] if out.tokens else -1)
    except (KeyboardInterrupt, GeneratorExit):
        out.finish_reason = "interrupted"
        raise
    finally:
        out.decode_seconds = time.perf_counter() - t0
