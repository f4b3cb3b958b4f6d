#!/usr/bin/env python3
"""Attention on the CPU backend alone: one sequence's queries (1: a decode step; more: a
speculative checking pass) against its cache, a model's heads and layers, at several cache
lengths; the fastest of --repeats runs of --calls calls, so that a shared machine's noise
stays out of it.

    python scripts/attention_bench.py                       # Qwen2.5-1.5B's heads, 28 layers
    python scripts/attention_bench.py --heads 9,3,64 --layers 30 --tokens 1   # SmolLM2's

For an A/B against other code, run it again with PYTHONPATH pointing at a tree whose folder is
named `fastrun` (`git archive OLD | tar -x -C /tmp/old/fastrun`).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--heads", default="12,2,128", help="query heads, KV heads, head size")
    ap.add_argument("--layers", type=int, default=28, help="calls a token's step makes")
    ap.add_argument("--tokens", default="1,5", help="queries of the one sequence a call has")
    ap.add_argument("--lengths", default="64,512,2048", help="cached positions before them")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    from fastrun.backends import get_backend

    backend = get_backend("cpu", threads=args.threads)
    rng = np.random.default_rng(0)
    h, hk, hd = (int(v) for v in args.heads.split(","))
    lengths = [int(v) for v in args.lengths.split(",")]
    tokens = [int(v) for v in args.tokens.split(",")]
    rows = max(lengths) + max(tokens)
    # fp16 values in float32 rows, as the CPU backend's cache holds them
    k_cache, v_cache = rng.standard_normal((2, rows, hk, hd)).astype(np.float16).astype(np.float32)
    print(f"{h} heads over {hk} KV heads of {hd}, {args.layers} layers, {args.threads} threads")
    print("| cached | queries | ms a step (all layers) | ms a query |")
    print("| --- | --- | --- | --- |")
    for length in lengths:
        for n in tokens:
            q = rng.standard_normal((n, h, hd)).astype(np.float32)
            pos = np.arange(length, length + n, dtype=np.int32)
            backend.attention(q, k_cache, v_cache, pos, hd**-0.5)  # compile, warm
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    backend.attention(q, k_cache, v_cache, pos, hd**-0.5)
                best = min(best, (time.perf_counter() - t0) / args.calls)
            step = best * args.layers * 1e3
            print(f"| {length} | {n} | {step:.2f} | {step / n:.2f} |", flush=True)


if __name__ == "__main__":
    main()
