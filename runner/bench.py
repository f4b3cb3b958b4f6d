"""llama-bench-style throughput measurement: prompt processing (pp) and token generation (tg)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from fastrun.runner.generate import decode_step


def bench_prefill(model, cache, n_prompt: int, rng: np.random.Generator) -> float:
    """Seconds to run n_prompt random tokens through the emptied cache (logits of the last)."""
    tf = model.transformer
    ids = rng.integers(0, tf.config.n_vocab, n_prompt)
    cache.trim(0)
    t0 = time.perf_counter()
    tf.forward(ids, cache)
    return time.perf_counter() - t0


def bench_decode(model, cache, n_gen: int, rng: np.random.Generator) -> float:
    """Seconds to generate n_gen greedy tokens one at a time from the emptied cache (llama-bench
    tg); the token is picked on the backend, as generation does."""
    tf = model.transformer
    cache.trim(0)
    token = int(rng.integers(0, tf.config.n_vocab))
    t0 = time.perf_counter()
    for _ in range(n_gen):
        token = int(decode_step(tf, cache, token, top_k=1).ids[0])
    return time.perf_counter() - t0


def run_bench(model, n_prompt: int, n_gen: int, reps: int, seed: int = 0) -> list[dict]:
    """Rows of {test, n, tokens_per_second: [per repetition], mean, sd}, after one warm-up."""
    rng = np.random.default_rng(seed)
    rows = []
    for test, n, fn in (("pp", n_prompt, bench_prefill), ("tg", n_gen, bench_decode)):
        if n <= 0:
            continue
        # one cache for all repetitions, as llama-bench (a CUDA decode graph is captured once)
        cache = model.transformer.new_cache(n + 1)
        fn(model, cache, min(n, 16), rng)  # warm-up: compiled kernels, caches, page faults
        rates = [n / fn(model, cache, n, rng) for _ in range(reps)]
        cache.free()
        rows.append(
            {
                "test": f"{test}{n}",
                "n": n,
                "tokens_per_second": rates,
                "mean": statistics.mean(rates),
                "sd": statistics.stdev(rates) if len(rates) > 1 else 0.0,
            }
        )
    return rows
