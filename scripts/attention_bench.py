#!/usr/bin/env python3
"""Decode attention on the CPU backend: one query token, SmolLM2's heads (9 query heads over 3
KV heads of 64), at several cache lengths; best of 5 runs of 200 calls.

    python scripts/attention_bench.py
"""

from __future__ import annotations

import time

import numpy as np


def main() -> None:
    from fastrun.backends import get_backend

    backend = get_backend("cpu")
    rng = np.random.default_rng(0)
    h, hk, hd = 9, 3, 64
    k_cache, v_cache = rng.standard_normal((2, 4096, hk, hd)).astype(np.float32)
    q = rng.standard_normal((1, h, hd)).astype(np.float32)
    for length in (64, 512, 4096):
        pos = np.array([length - 1], np.int32)
        backend.attention(q, k_cache, v_cache, pos, hd**-0.5)  # compile, warm
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                backend.attention(q, k_cache, v_cache, pos, hd**-0.5)
            best = min(best, (time.perf_counter() - t0) / 200)
        print(f"cache length {length:5d}: {best * 1e6:8.1f} us per call")


if __name__ == "__main__":
    main()
