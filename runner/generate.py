"""What a sequence does with each token it samples: the Token pieces it emits, end-of-generation
tokens, stop strings and the token budget, and the Completion that records it all. The engine
(engine.py) runs one Continuation per sequence."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fastrun.runner.sampling import SamplingParams


class Token(str):
    """A generated piece of text that also carries its token id (`.id`), and where the request
    asked for them, its log-probability and the most likely alternatives
    (`.top_logprobs`: [(id, logprob)], best first).

    The text can be empty while a multi-byte character is still incomplete.
    """

    id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None

    def __new__(cls, text: str, tid: int, logprob=None, top_logprobs=None):
        obj = super().__new__(cls, text)
        obj.id = tid
        obj.logprob = logprob
        obj.top_logprobs = top_logprobs
        return obj


@dataclass
class Completion:
    """What one generation produced; filled in while its stream runs."""

    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually run (the rest came from cached cells)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "interrupted"
    queue_seconds: float = 0.0  # waiting for a free sequence
    prefill_seconds: float = 0.0  # from the start of its prefill to its first token
    decode_seconds: float = 0.0  # from the first token to the last
    context_shifts: int = 0
    draft_rounds: int = 0  # speculative decoding: target passes that checked drafted tokens,
    drafted_tokens: int = 0  # the tokens drafted for them
    accepted_tokens: int = 0  # and those accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafted tokens accepted per checking pass (each pass also yields one of its own)."""
        return self.accepted_tokens / self.draft_rounds if self.draft_rounds else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prefill's logits
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds and n else 0.0

    @property
    def time_to_first_token(self) -> float:
        return self.queue_seconds + self.prefill_seconds


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


class Continuation:
    """Turns the sampled tokens of one sequence into Token pieces: end-of-generation ids, the
    incremental detokenizer, stop strings (text that could still become one is held back)
    and the budget of max_tokens. `push` takes a token and returns the piece to emit (or
    None) and whether generation is over; `finish` flushes what is held."""

    def __init__(self, tokenizer, params: SamplingParams, out: Completion):
        self.params = params
        self.out = out
        self.eog = frozenset() if params.ignore_eos else tokenizer.eog_ids
        self.decoder = tokenizer.stream_decoder()
        self.pending = ""  # decoded text not yet emitted: it may be the start of a stop string
        self.started = time.perf_counter()

    @property
    def remaining(self) -> int:
        """Tokens the budget of max_tokens still allows."""
        return self.params.max_tokens - len(self.out.tokens)

    def push(self, token: int, logprobs: np.ndarray | None = None) -> tuple[Token | None, bool]:
        out, params = self.out, self.params
        if not out.tokens:
            now = time.perf_counter()
            out.prefill_seconds, self.started = now - self.started, now
        if token in self.eog:
            out.finish_reason = "stop"
            return None, True
        out.tokens.append(token)
        self.pending += self.decoder.push(token)
        logprob = top = None
        if logprobs is not None:
            logprob = float(logprobs[token])
            n = params.logprobs or 0
            best = np.argsort(-logprobs, kind="stable")[:n]
            top = [(int(i), float(logprobs[i])) for i in best]
        ready = len(self.pending)
        if params.stop:
            found = (self.pending.find(s) for s in params.stop)
            hit = min((i for i in found if i >= 0), default=-1)
            if hit >= 0:
                out.text += self.pending[:hit]
                piece = Token(self.pending[:hit], token, logprob, top)
                self.pending = ""
                out.finish_reason = "stop"
                return piece, True
            ready -= _held_back(self.pending, params.stop)
        out.text += self.pending[:ready]
        piece = Token(self.pending[:ready], token, logprob, top)
        self.pending = self.pending[ready:]
        if len(out.tokens) >= params.max_tokens:
            out.finish_reason = "length"
            return piece, True
        return piece, False

    def finish(self, reason: str | None = None) -> Token | None:
        """End the generation (reason: why, unless push already said); returns the text still
        held back, if any, as a last piece."""
        out = self.out
        if reason and out.finish_reason is None:
            out.finish_reason = reason
        if out.tokens:
            out.decode_seconds = time.perf_counter() - self.started
        else:
            out.prefill_seconds = time.perf_counter() - self.started
        if out.finish_reason not in ("stop", "length"):
            return None
        text = self.pending + self.decoder.flush()
        self.pending = ""
        if not text:
            return None
        out.text += text
        return Token(text, out.tokens[-1] if out.tokens else -1)
