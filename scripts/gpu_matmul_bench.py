#!/usr/bin/env python3
"""The CUDA backend's quantized matrix products alone, at decode-sized batches, over the four
products of a few transformer layers (more weight bytes than the L2 holds), in GB/s of weights
streamed: whichever kernel the backend picks for each count of tokens.

    python scripts/gpu_matmul_bench.py --shape llama2-7b --types Q4_0 Q4_K --tokens 1 2 4 8 16
    FASTRUN_SMALL_BATCH=0 python scripts/gpu_matmul_bench.py ...  # without matvec_tile
    FASTRUN_SMALL_BATCH=0 FASTRUN_MATVEC_BATCH=16 python ...  # the one-token matvec throughout

Picks SMALL_BATCH, SMALL_TILES, MATVEC_BATCH, MMA_SM_WARPS and MMA_WARPS in
backends/cuda/backend.py; scripts/gpu_kernel_check.py compares the old and new directly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS = 4


def main() -> None:
    import cupy as cp
    from gpu_bench import SHAPES

    from fastrun.backends.cuda.backend import CUDABackend
    from fastrun.backends.cuda.weights import BLOCK_BYTES, SUPER_BYTES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b", choices=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    _, d, ff, *_ = SHAPES[args.shape]
    backend = CUDABackend()
    rng = np.random.default_rng(0)
    shapes = [(3 * d, d), (d, d), (2 * ff, d), (d, ff)]  # qkv, o, gate+up, down: (n_out, n_in)
    for qtype in args.types:
        if qtype in SUPER_BYTES:
            block, nbytes = 256, SUPER_BYTES[qtype]
        else:
            block, nbytes = 32, BLOCK_BYTES[qtype]
        weights = []
        for _ in range(LAYERS):
            for n_out, n_in in shapes:
                raw = cp.random.randint(0, 256, (n_out, n_in // block * nbytes), cp.uint8)
                # finite fp16 scales: every odd byte's exponent bits kept below the maximum
                raw[:, 1::2] &= 0x3B
                weights.append(backend.load_weight(raw, qtype, n_out, n_in))
        total = sum(w.nbytes for w in weights)
        print(f"{qtype}: {len(weights)} products, {total / 1e6:.0f} MB of weights")
        per_256 = qtype.endswith("_K")
        line = []
        for n in args.tokens:
            xs = {k: cp.asarray(rng.standard_normal((n, k)), cp.float32) for _, k in shapes}
            acts = {k: backend._quantize(x, per_256) for k, x in xs.items()}
            outs = {w.n_out: cp.empty((n, w.n_out), cp.float32) for w in weights}

            def run(xs=xs, acts=acts, outs=outs, weights=weights):
                for w in weights:
                    backend._product(xs[w.n_in], acts[w.n_in], w, outs[w.n_out])

            line.append(f"n={n}: {total / event_time(run) / 1e9:5.0f}")
        print("  GB/s  " + "  ".join(line))


def event_time(run, repeat: int = 5) -> float:
    """Median seconds of run() over repeat timed calls, after a warm-up."""
    import cupy as cp

    run()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


if __name__ == "__main__":
    main()
