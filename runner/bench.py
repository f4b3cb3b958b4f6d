"""Throughput as llama.cpp's benches measure it: prompt processing (pp) and token generation (tg)
of one sequence on the model itself (llama-bench), and aggregate speed of parallel sequences
through the engine's batcher (llama-batched-bench)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from fastrun.runner.batch import Batch


def _fill(model, cache, depth: int, rng: np.random.Generator) -> None:
    """The emptied cache, then `depth` random tokens in it: the context a test runs after
    (llama-bench -d). Filled anew for each repetition, as a test's tokens cannot always be
    rolled back (a sliding-window layer's ring has overwritten what they replaced)."""
    cache.trim(0)
    if depth:
        model.transformer.forward(rng.integers(0, model.transformer.config.n_vocab, depth), cache)


def bench_prefill(model, cache, n_prompt: int, rng: np.random.Generator, depth: int = 0) -> float:
    """Seconds to run n_prompt random tokens after `depth` cached ones (logits of the last)."""
    tf = model.transformer
    ids = rng.integers(0, tf.config.n_vocab, n_prompt)
    _fill(model, cache, depth, rng)
    t0 = time.perf_counter()
    tf.forward(ids, cache)
    return time.perf_counter() - t0


def bench_decode(model, cache, n_gen: int, rng: np.random.Generator, depth: int = 0) -> float:
    """Seconds to generate n_gen greedy tokens after `depth` cached ones (llama-bench tg), as
    greedy generation runs them (greedy_decode)."""
    tf = model.transformer
    _fill(model, cache, depth, rng)
    token = int(rng.integers(0, tf.config.n_vocab))
    t0 = time.perf_counter()
    greedy_decode(tf, cache.cells, [cache], [token], n_gen)
    return time.perf_counter() - t0


def greedy_decode(tf, cells, sequences: list, tokens: list[int], n: int) -> list[int]:
    """n greedy tokens of each sequence after its token, each picked on the backend and, as
    the engine does, up to the backend's chain_steps of them in one pass. Returns the last
    picks."""
    made = 0
    while made < n:
        steps = min(tf.backend.chain_steps, n - made)
        batch = Batch()
        for seq, token in zip(sequences, tokens, strict=True):
            batch.add(seq, [token])
        tokens = tf.run_chain(batch, cells, steps)[-1].tolist()
        made += steps
    return tokens


def run_bench(
    model, n_prompt: int, n_gen: int, reps: int, seed: int = 0, depth: int = 0
) -> list[dict]:
    """Rows of {test, n, depth, tokens_per_second: [per repetition], mean, sd}, after one
    warm-up; on the engine's thread, which owns the backend. depth: tokens in the cache
    before each test, as llama-bench -d (its test names: "tg64 @ d2048")."""
    return model.engine.call(lambda: _bench_model(model, n_prompt, n_gen, reps, seed, depth))


def _bench_model(model, n_prompt: int, n_gen: int, reps: int, seed: int, depth: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for test, n, fn in (("pp", n_prompt, bench_prefill), ("tg", n_gen, bench_decode)):
        if n <= 0:
            continue
        # one cache for all repetitions, as llama-bench (a CUDA decode graph is captured once)
        cache = model.transformer.new_cache(depth + n + 1)
        fn(model, cache, min(n, 16), rng)  # warm-up: compiled kernels, caches, page faults
        rates = [n / fn(model, cache, n, rng, depth) for _ in range(reps)]
        cache.free()
        rows.append(
            {
                "test": f"{test}{n}" + (f" @ d{depth}" if depth else ""),
                "n": n,
                "depth": depth,
                "tokens_per_second": rates,
                "mean": statistics.mean(rates),
                "sd": statistics.stdev(rates) if len(rates) > 1 else 0.0,
            }
        )
    return rows


def bench_parallel(model, n_seq: int, n_prompt: int, n_gen: int, rng) -> dict:
    """n_seq sequences of random n_prompt-token prompts submitted at once, each generating
    n_gen tokens after its first (greedy, end of text ignored), as llama-batched-bench: the
    prompts' time until every sequence has its first token, then the decode steps."""
    vocab = model.config.n_vocab
    t0 = time.perf_counter()
    streams = [
        model.generate(
            rng.integers(0, vocab, n_prompt).tolist(),
            max_tokens=n_gen + 1,
            temperature=0,
            ignore_eos=True,
        )  # fmt: skip
        for _ in range(n_seq)
    ]
    for stream in streams:
        for _ in stream:
            pass
    total = time.perf_counter() - t0
    done = [s.completion for s in streams]
    t_pp = max(d.queue_seconds + d.prefill_seconds for d in done)
    t_tg = max(total - t_pp, 1e-9)
    return {
        "npl": n_seq, "npp": n_prompt, "ntg": n_gen, "t_pp": t_pp, "t_tg": t_tg,
        "s_pp": n_seq * n_prompt / t_pp, "s_tg": n_seq * n_gen / t_tg,
        "s": n_seq * (n_prompt + n_gen) / total,
    }  # fmt: skip


def run_parallel_bench(
    model, parallels: list[int], n_prompt: int, n_gen: int, reps: int, seed: int = 0
) -> list[dict]:
    """Per number of parallel sequences, the median of reps runs (after a warm-up) of
    bench_parallel through the model's engine."""
    rng = np.random.default_rng(seed)
    bench_parallel(model, max(parallels), min(n_prompt, 8), 4, rng)  # warm-up: compile, fault
    rows = []
    for n_seq in parallels:
        runs = [bench_parallel(model, n_seq, n_prompt, n_gen, rng) for _ in range(reps)]
        runs.sort(key=lambda r: r["s_tg"])
        rows.append({**runs[len(runs) // 2], "s_tg_runs": [r["s_tg"] for r in runs]})
    return rows
