#!/usr/bin/env python3
"""The CPU backend's quantized products alone: one weight times 1, 8 or 256 activation rows.

    python scripts/cpu_matmul_bench.py --threads 1 Q4_K:896x4864 Q6_K:896x4864 Q5_0:4864x896
    python scripts/cpu_matmul_bench.py -t 2 --copies 24 --rows 1 4 5 8 Q4_K:8960x1536

--copies N multiplies N copies of the weight in turn, so that they stream from memory as a
decode step's do (one copy stays in the last-level cache after its first product).

Times are CPU seconds of the process (time.process_time), median of 5: on a machine that
other work shares, what the kernel costs rather than how long it waited for a core. For an
A/B against other code, run it again with PYTHONPATH pointing at a tree whose folder is
named `fastrun` (for example `git archive OLD | tar -x -C /tmp/old/fastrun`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import random_blocks  # noqa: E402

import fastrun  # noqa: E402
from fastrun.backends import get_backend  # noqa: E402


def cpu_seconds(fn, reps: int) -> float:
    runs = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(reps):
            fn()
        runs.append((time.process_time() - start) / reps)
    return sorted(runs)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("weights", nargs="+", help="TYPE:N_OUTxN_IN, e.g. Q4_K:896x4864")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 256])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--copies", type=int, default=1, help="weights multiplied in turn")
    args = ap.parse_args()
    cpu = get_backend("cpu")
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"fastrun from {Path(fastrun.__file__).parent}, {args.threads} thread(s)")
    print("| weight | shape | rows | CPU ms | G weight-row products/s |")
    print("| --- | --- | --- | --- | --- |")
    for spec in args.weights:
        qtype, shape = spec.split(":")
        n_out, n_in = (int(v) for v in shape.split("x"))
        blocks = random_blocks(qtype, n_out, n_in, rng, fast=True)
        ws = [cpu.load_weight(blocks.copy(), qtype, n_out, n_in) for _ in range(args.copies)]
        for n in args.rows:
            x = rng.standard_normal((n, n_in)).astype(np.float32)
            for w in ws:
                cpu.matmul(x, w)  # compiles, repacks
            reps = max(3, int(2e8 / (n_out * n_in * n)))
            turns = -(-reps // len(ws))  # rounds over the copies

            def products(x=x, ws=ws):
                for w in ws:
                    cpu.matmul(x, w)

            t = cpu_seconds(products, turns) / len(ws)
            rate = n_out * n_in * n / t / 1e9
            print(f"| {qtype} | {n_out} x {n_in} | {n} | {t * 1e3:.3f} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
