#!/usr/bin/env python3
"""The CUDA backend's quantized matrix kernels alone, at decode-sized batches: the dp4a matvec
against tensor-core tilings, over the four products of a few transformer layers (more weight
bytes than the L2 holds), in GB/s of weights streamed.

    python scripts/gpu_matmul_bench.py --shape llama2-7b --types Q4_0 Q4_K --tokens 1 2 4 8 16

Picks MATVEC_BATCH and MMA_TILES in backends/cuda/backend.py.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

MMA_VARIANTS = [(1, 2)]  # (16-row tiles, 8-token tiles) per block
LAYERS = 4


def main() -> None:
    import cupy as cp
    from gpu_bench import SHAPES

    from fastrun.backends.cuda.backend import MATVEC_TUNING, SOURCES, CUDABackend
    from fastrun.backends.cuda.weights import BLOCK_BYTES, KERNEL_FORMATS, SUPER_BYTES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b", choices=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    _, d, ff, *_ = SHAPES[args.shape]
    backend = CUDABackend()
    names = [n for f in KERNEL_FORMATS.values() for n in _names(f)]
    module = cp.RawModule(
        code=(SOURCES / "matmul.cu").read_text(),
        options=(
            "-std=c++17",
            f"-I{SOURCES}",
            f"-DMV_ROWS={MATVEC_TUNING[0]}",
            f"-DMV_UNROLL1={MATVEC_TUNING[1]}",
        ),
        name_expressions=names,
    )
    rng = np.random.default_rng(0)
    shapes = [(3 * d, d), (d, d), (2 * ff, d), (d, ff)]  # qkv, o, gate+up, down: (n_out, n_in)
    for qtype in args.types:
        f = KERNEL_FORMATS[qtype]
        block, nbytes = (256, SUPER_BYTES[qtype]) if qtype in SUPER_BYTES else (32, 0)
        nbytes = nbytes or BLOCK_BYTES[qtype]
        weights = []
        for _ in range(LAYERS):
            for n_out, n_in in shapes:
                raw = cp.random.randint(0, 256, (n_out, n_in // block * nbytes), cp.uint8)
                # finite fp16 scales: every odd byte's exponent bits kept below the maximum
                raw[:, 1::2] &= 0x3B
                weights.append(backend.load_weight(raw, qtype, n_out, n_in))
        total = sum(w.nbytes for w in weights)
        print(f"{qtype}: {len(weights)} products, {total / 1e6:.0f} MB of weights")
        for n in args.tokens:
            acts = {}  # (n_in, group-major layout) -> the quantized activation
            for k in {s[1] for s in shapes}:
                x = cp.asarray(rng.standard_normal((n, k)), cp.float32)
                for major in (False, True):
                    acts[k, major] = backend._quantize(x, qtype.endswith("_K"), group_major=major)
            outs = {w.n_out: cp.empty((n, w.n_out), cp.float32) for w in weights}
            line = []
            for label, *launch, major in _kernels(module, f, n):
                layout = {k: a for (k, m), a in acts.items() if m == major}
                seconds = _time(partial(_products, weights, layout, outs, n, *launch))
                line.append(f"{label} {total / seconds / 1e9:6.0f}")
            print(f"  n={n:3d}  GB/s: " + "  ".join(line))


def _names(f: str) -> list[str]:
    names = [f"matvec_q<{f}, {t}>" for t in (1, 2, 4, 8)]
    return names + [f"matmul_mma<{f}, {m}, {t}>" for m, t in MMA_VARIANTS]


def _products(weights, acts, outs, n, kernel, rows_per_block, tokens_per_block, threads):
    """Every weight's product with its activation through one kernel."""
    from fastrun.backends.cuda.backend import _i32

    for w in weights:
        grid = (-(-w.n_out // rows_per_block), -(-n // tokens_per_block))
        args = (*w.plane_args(), *acts[w.n_in], outs[w.n_out])
        kernel(grid, (threads,), args + (_i32(w.n_in), _i32(w.n_out), _i32(n), _i32(0)))


def _kernels(module, f: str, n: int):
    """(label, kernel, weight rows per block, tokens per block, threads, group-major
    activations) for n tokens."""
    t = next((t for t in (1, 2, 4, 8) if t >= n), 8)
    yield f"matvec/{t}", module.get_function(f"matvec_q<{f}, {t}>"), 16, t, 256, False
    for m, t8 in MMA_VARIANTS:
        if n <= 8 and t8 > 2:
            continue
        kernel = module.get_function(f"matmul_mma<{f}, {m}, {t8}>")
        yield f"mma{m}x{t8}", kernel, 16 * m, 8 * t8, 256, True


def _time(run, repeat: int = 5) -> float:
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
