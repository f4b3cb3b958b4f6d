"""llama-bench-style throughput measurement: prompt processing (pp) and token generation (tg)."""

from __future__ import annotations

import statistics
import time

import numpy as np


def bench_prefill(model, n_prompt: int, rng: np.random.Generator) -> float:
    """Seconds to run n_prompt random tokens through a fresh cache (logits of the last only)."""
    tf = model.transformer
    ids = rng.integers(0, tf.config.n_vocab, n_prompt)
    cache = tf.new_cache(n_prompt)
    t0 = time.perf_counter()
    tf.forward(ids, cache)
    dt = time.perf_counter() - t0
    cache.free()
    return dt


def bench_decode(model, n_gen: int, rng: np.random.Generator) -> float:
    """Seconds to generate n_gen tokens one at a time, from an empty cache (llama-bench tg)."""
    tf = model.transformer
    cache = tf.new_cache(n_gen + 1)
    token = int(rng.integers(0, tf.config.n_vocab))
    t0 = time.perf_counter()
    for _ in range(n_gen):
        token = int(np.argmax(tf.forward([token], cache)[-1]))
    dt = time.perf_counter() - t0
    cache.free()
    return dt


def run_bench(model, n_prompt: int, n_gen: int, reps: int, seed: int = 0) -> list[dict]:
    """Rows of {test, n, tokens_per_second: [per repetition], mean, sd}, after one warm-up."""
    rng = np.random.default_rng(seed)
    rows = []
    for test, n, fn in (("pp", n_prompt, bench_prefill), ("tg", n_gen, bench_decode)):
        if n <= 0:
            continue
        fn(model, min(n, 16), rng)  # warm-up: compiled kernels, caches, page faults
        rates = [n / fn(model, n, rng) for _ in range(reps)]
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
