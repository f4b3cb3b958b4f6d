"""Perplexity and KL divergence by llama-perplexity's method.

The text is tokenized once (BOS first where the model adds one) and cut into chunks of n_ctx
tokens; each chunk runs from an empty cache, its first token replaced by BOS where the model
adds one, and only the second half is scored (each scored token has at least n_ctx / 2 tokens
of context): n_ctx - 1 - n_ctx // 2 predictions per chunk. PPL = exp(mean negative
log-likelihood), with the standard error of that mean carried through the exponential.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import numpy as np

from fastrun.formats.errors import FastrunError
from fastrun.runner.logprob_file import LogprobFile, LogprobWriter


@dataclass
class Scores:
    """Running sums of log-likelihoods (and of KL divergences against a base)."""

    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0
    kld: list = field(default_factory=list)  # per-chunk arrays of per-token KL
    same_top: int = 0
    base_nll: float = 0.0

    def ppl(self) -> tuple[float, float]:
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        err = math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0
        return math.exp(mean), err * math.exp(mean)


@dataclass
class PerplexityResult:
    n_ctx: int
    n_chunks: int
    scores: Scores
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.n_chunks * self.n_ctx / max(self.seconds, 1e-9)

    def kl_summary(self) -> dict | None:
        """llama-perplexity's KL figures: mean KL (± standard error), its spread, same top-1."""
        if not self.scores.kld:
            return None
        kld = np.concatenate(self.scores.kld)
        n = kld.size
        same = self.scores.same_top / n
        return {
            "ppl_base": math.exp(self.scores.base_nll / n),
            "mean_kld": float(kld.mean()),
            "mean_kld_err": float(kld.std() / math.sqrt(max(n - 1, 1))),
            "max_kld": float(kld.max()),
            "kld_99": float(np.percentile(kld, 99)),
            "median_kld": float(np.median(kld)),
            "same_top": same,
            "same_top_err": math.sqrt(same * (1 - same) / max(n - 1, 1)),
        }


def chunk_tokens(tokens: list[int], n_ctx: int, n_chunks: int | None) -> np.ndarray:
    """The whole chunks of n_ctx tokens to evaluate, [n_chunk, n_ctx]."""
    if n_ctx < 8:
        raise FastrunError(f"context {n_ctx} is too small for perplexity (at least 8)")
    available = len(tokens) // n_ctx
    if available < 2:
        raise FastrunError(
            f"the text has {len(tokens)} tokens; perplexity with -c {n_ctx} needs at least "
            f"{2 * n_ctx}"
        )
    n = available if n_chunks is None else min(n_chunks, available)
    return np.asarray(tokens[: n * n_ctx], np.int32).reshape(n, n_ctx)


def _chunk_logprobs(model, ids: np.ndarray, bos: int | None) -> np.ndarray:
    """Log-probabilities at the scored positions of one chunk, [n_scored, n_vocab].

    As llama-perplexity does, only the scored positions get logits: the first half of the
    chunk is prefilled without the output projection (a fifth of a small model's work per
    token) and the last token, a target only, is not run at all. Passes are as large as the
    model prefills (PREFILL_CHUNK tokens) and run on the thread that owns the backend."""
    from fastrun.runner.batch import Batch
    from fastrun.runner.models.base import PREFILL_CHUNK

    n_ctx = ids.size
    ids = [int(i) for i in ids]
    if bos is not None:
        ids[0] = bos
    first, end = n_ctx // 2, n_ctx - 1  # logits at first..end-1 predict tokens first+1..end
    transformer = model.transformer

    def score():
        cache = transformer.new_cache(n_ctx)
        outputs = []
        try:
            for start in range(0, end, PREFILL_CHUNK):
                stop = min(start + PREFILL_CHUNK, end)
                batch = Batch()
                if start < first:
                    batch.add(cache, ids[start : min(stop, first)], "none")
                if stop > first:
                    batch.add(cache, ids[max(start, first) : stop], "all")
                out = transformer.run(batch, cache.cells)
                if out is not None:
                    outputs.append(out)
        finally:
            cache.free()
        return np.concatenate(outputs) if len(outputs) > 1 else outputs[0]

    logits = np.asarray(model.engine.call(score), np.float32)
    # in place: each 50 MB temporary of a chunk's 255 x 49152 scores costs page faults
    logits -= logits.max(axis=1, keepdims=True)
    logits -= np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return logits


def evaluate(
    model,
    tokens: list[int],
    n_ctx: int,
    n_chunks: int | None = None,
    base: LogprobFile | None = None,
    save_to: str | None = None,
    progress=None,
) -> PerplexityResult:
    """Score a model (a fastrun.runner.api.Model) on tokens; optionally compare against a
    saved base or save this model's log-probabilities as a base."""
    chunks = chunk_tokens(tokens, n_ctx, n_chunks)
    if base is not None:
        chunks = _match_base(chunks, base, model.config)
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    scores = Scores()
    first = n_ctx // 2
    if progress is not None:
        progress.start(len(chunks))
    saver = (
        LogprobWriter(save_to, n_ctx, model.config.n_vocab, chunks.reshape(-1))
        if save_to is not None
        else contextlib.nullcontext()
    )
    start = time.perf_counter()
    with saver as writer:
        for i, ids in enumerate(chunks):
            logprobs = _chunk_logprobs(model, ids, bos)
            targets = ids[first + 1 :]
            picked = logprobs[np.arange(targets.size), targets].astype(np.float64)
            scores.count += targets.size
            scores.nll -= picked.sum()
            scores.nll2 += (picked * picked).sum()
            if writer is not None:
                writer.append(logprobs)
            if base is not None:
                _compare(scores, np.asarray(base.logprobs[i], np.float32), logprobs, targets)
            if progress is not None:
                ppl, _ = scores.ppl()
                progress.advance(1, f"chunk {i + 1}/{len(chunks)} PPL {ppl:.4f}")
    return PerplexityResult(n_ctx, len(chunks), scores, time.perf_counter() - start)


def _match_base(chunks: np.ndarray, base: LogprobFile, config) -> np.ndarray:
    if base.n_ctx != chunks.shape[1]:
        raise FastrunError(f"the base was made with -c {base.n_ctx}; use the same context")
    if base.n_vocab != config.n_vocab:
        raise FastrunError(f"the base has {base.n_vocab} tokens in its vocabulary, the model "
                           f"{config.n_vocab}")  # fmt: skip
    n = min(len(chunks), base.n_chunk)
    if not np.array_equal(base.tokens[: n * base.n_ctx], chunks[:n].reshape(-1)):
        raise FastrunError("the text tokenizes differently from the base's; same file and model?")
    return chunks[:n]


def _compare(scores: Scores, base: np.ndarray, current: np.ndarray, targets) -> None:
    """Per-token KL(base || current) and whether the most likely token is the same."""
    p = np.exp(base)
    kld = (p * (base - current)).sum(axis=1, dtype=np.float64)
    scores.kld.append(np.maximum(kld, 0.0))
    scores.same_top += int((base.argmax(axis=1) == current.argmax(axis=1)).sum())
    scores.base_nll -= float(base[np.arange(targets.size), targets].astype(np.float64).sum())
