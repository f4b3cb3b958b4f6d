#!/usr/bin/env python3
"""Where a CUDA prefill's time goes: a prompt of -p tokens on a model of a benchmark shape
with random weights, timed --repeat times (each one alone, to show the spread), then with
--kernels each kernel's own duration as Nsight Compute reports it (run under ncu):

    python scripts/gpu_prefill_profile.py --shape llama2-7b --type Q4_0 --repeat 8
    ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file k.csv \\
        --nvtx --nvtx-include prefill/ python scripts/gpu_prefill_profile.py --repeat 1
    python scripts/gpu_decode_profile.py --kernels k.csv   # per-kernel table

FASTRUN_DENSE_ROWS (default 128) is the prompt length from which products go through cuBLAS.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    from gpu_bench import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b", choices=list(SHAPES))
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument(
        "--dense-rows", type=int, nargs="+", help="each in turn as the cuBLAS threshold"
    )
    ap.add_argument("--profile", type=int, default=0, help="then the host's top N functions")
    args = ap.parse_args()

    from helpers import write_tiny_model

    from fastrun.backends import get_backend
    from fastrun.backends.cuda import backend as cuda_backend
    from fastrun.formats.gguf import GGUFFile
    from fastrun.runner.models import model_class

    arch, d, ff, n_layer, h, hk, vocab = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        shape = (d, ff, n_layer, h, hk, vocab, 4096)
        write_tiny_model(path, arch, args.type, *shape, tied=False, fast=True)
        model = model_class(GGUFFile(str(path)).architecture)(
            GGUFFile(str(path)), get_backend("cuda")
        )
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, args.n_prompt)]
        for dense_rows in args.dense_rows or [cuda_backend.DENSE_ROWS]:
            cuda_backend.DENSE_ROWS = dense_rows
            print(f"cuBLAS from {dense_rows} tokens:", end=" ")
            measure(model, prompt, args)


def measure(model, prompt, args) -> None:
    import cupy as cp

    cache = model.new_cache(args.n_prompt + 1)
    model.forward(prompt, cache)  # compile and warm
    times = []
    for _ in range(args.repeat):
        cache.trim(0)
        cp.cuda.Device().synchronize()
        cp.cuda.nvtx.RangePush("prefill")
        t0 = time.perf_counter()
        model.forward(prompt, cache)
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
        cp.cuda.nvtx.RangePop()
    rates = [args.n_prompt / t for t in times]
    print(
        f"{args.shape} {args.type} pp{args.n_prompt}: median {np.median(rates):.0f} tok/s "
        f"(each: {' '.join(f'{r:.0f}' for r in rates)})"
    )
    if args.profile:  # where the host's time goes (a prefill of a small model is the host's)
        import cProfile
        import pstats

        cache.trim(0)
        cp.cuda.Device().synchronize()
        profiler = cProfile.Profile()
        profiler.runcall(model.forward, prompt, cache)
        cp.cuda.Device().synchronize()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.profile)
        stats.sort_stats("cumulative").print_stats(args.profile)
    cache.free()


if __name__ == "__main__":
    main()
