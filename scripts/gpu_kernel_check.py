#!/usr/bin/env python3
"""The CUDA products of a few tokens (matvec_tile, matmul.cu) checked and timed on the device
in one call: each part prints as it goes and a failure in one does not stop the others.

    python scripts/gpu_kernel_check.py                       # every part, about 6-8 minutes
    python scripts/gpu_kernel_check.py --parts correct,time --json $OUT/check.json

Parts:
  correct  every weight format, 1..16 tokens: the new path against the NumPy reference (max abs
           error over max |reference|), and bit for bit against the dp4a matvec (matvec_q),
           staged and unstaged activations alike
  time     the 7B-shaped products (n_out x n_in: 4096x4096, 11008x4096, 4096x11008, 32000x4096)
           for Q4_0 and Q4_K at 1, 2, 4, 8, 9, 16 tokens, the old dispatch (dp4a matvec up to 4
           tokens, tensor cores above) against the new, in GB/s of weights and time over n=1's
  sweep    matvec_tile's shapes (tokens a block, rows a warp, groups in flight, warps a block,
           staged or not) on two of the products; the best per bucket as FASTRUN_SMALL_TILES
  verify   scripts/spec_bench.py --verify-cost --shape llama2-7b: old, new, new with the old
           attention splits
  tg       scripts/gpu_bench.py on the 7B Q4_0 shape (tg128 at depth 512, batch 1 and 16),
           old against new

The old dispatch is FASTRUN_SMALL_BATCH=0 FASTRUN_GRAPH_EXACT=0 FASTRUN_ATTN_FEW_BLOCKS=256.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_matmul_bench import event_time  # noqa: E402  (CUDA events, median of repeats)

OLD_ENV = {"FASTRUN_SMALL_BATCH": "0", "FASTRUN_GRAPH_EXACT": "0", "FASTRUN_ATTN_FEW_BLOCKS": "256"}
TOKENS = (1, 2, 4, 8, 9, 16)
SHAPES_7B = ((4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096))  # (n_out, n_in)
STREAM_BYTES = 128 << 20  # weights a timed run walks through: past the L2 (50-60 MB)
# matvec_tile shapes the sweep compiles per bucket of tokens: (rows a warp, groups in flight)
SWEEP_TILES = {
    1: ((1, 2), (1, 4), (2, 2), (2, 4)),
    2: ((1, 2), (2, 2), (4, 2), (2, 1)),
    4: ((1, 2), (2, 2), (4, 1), (4, 2)),
    8: ((2, 1), (2, 2), (4, 1), (4, 2)),
    16: ((2, 1), (2, 2), (4, 1)),
}
SWEEP_WARPS = (4, 8)
SWEEP_SHAPES = ((11008, 4096),)

started = time.perf_counter()
results: dict = {}


def log(*parts) -> None:
    print(f"[{time.perf_counter() - started:6.1f}s]", *parts, flush=True)


@contextmanager
def dispatch(**settings):
    """The CUDA backend's module settings (SMALL_BATCH, MATVEC_BATCH, ...) changed for a while;
    they are read at each call, so products launched inside take them."""
    import fastrun.backends.cuda.backend as cb

    saved = {k: getattr(cb, k) for k in settings}
    for k, v in settings.items():
        setattr(cb, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cb, k, v)


OLD = dict(SMALL_BATCH=0)  # in-process: the old split of products (graphs are not involved)
MATVEC_ONLY = dict(SMALL_BATCH=0, MATVEC_BATCH=16)  # matvec_q for every count up to 16


# -- correct ------------------------------------------------------------------------------------


def part_correct(backend) -> None:
    import cupy as cp
    from helpers import random_blocks

    from fastrun.backends.cuda.weights import KERNEL_FORMATS
    from fastrun.backends.reference import ReferenceBackend

    ref = ReferenceBackend()
    rng = np.random.default_rng(0)
    worst, unequal = 0.0, []
    for qtype in KERNEL_FORMATS:
        for n_out, n_in in ((200, 512), (72, 3328)):  # rows not a multiple of a block's
            raw = random_blocks(qtype, n_out, n_in, rng)
            w_ref = ref.load_weight(raw, qtype, n_out, n_in)
            w = backend.load_weight(raw, qtype, n_out, n_in)
            errs = []
            for n in range(1, 17):
                x = rng.standard_normal((n, n_in)).astype(np.float32)
                expect = ref.matmul(x, w_ref)
                xd = cp.asarray(x)
                got = {}
                with dispatch():
                    got["new"] = cp.asnumpy(backend.matmul(xd, w))
                with dispatch(SMALL_STAGE=0):
                    got["unstaged"] = cp.asnumpy(backend.matmul(xd, w))
                with dispatch(**MATVEC_ONLY):
                    got["matvec_q"] = cp.asnumpy(backend.matmul(xd, w))
                with dispatch(**OLD):
                    got["old"] = cp.asnumpy(backend.matmul(xd, w))
                scale = float(np.abs(expect).max())
                err = {k: float(np.abs(v - expect).max()) / scale for k, v in got.items()}
                errs.append(err["new"])
                worst = max(worst, err["new"], err["unstaged"])
                for k in ("unstaged", "matvec_q"):
                    if not np.array_equal(got["new"], got[k]):
                        unequal.append((qtype, n_in, n, k))
                if err["new"] > 1e-4 or err["unstaged"] > 1e-4:
                    log(f"  FAIL {qtype} {n_out}x{n_in} n={n}: {err}")
            log(f"{qtype:5s} {n_out}x{n_in}: new rel err max {max(errs):.2e} over n=1..16")
    results["correct"] = {"worst_rel_err": worst, "not_bit_identical": unequal}
    log(f"correct: worst rel err {worst:.2e} (parity tolerance 1e-4)")
    log(f"correct: new path not bit-identical to matvec_q / unstaged in {len(unequal)} cases")
    for case in unequal[:20]:
        log("   ", case)


# -- time ---------------------------------------------------------------------------------------


def weight_copies(backend, qtype: str, n_out: int, n_in: int) -> list:
    """Enough random copies of an n_out x n_in weight to stream STREAM_BYTES through."""
    import cupy as cp

    from fastrun.backends.cuda.weights import BLOCK_BYTES, SUPER_BYTES

    block, nbytes = (256, SUPER_BYTES[qtype]) if qtype in SUPER_BYTES else (32, BLOCK_BYTES[qtype])
    raw = cp.random.randint(0, 256, (n_out, n_in // block * nbytes), cp.uint8)
    raw[:, 1::2] &= 0x3B  # finite fp16 scales: exponent bits kept below the maximum
    first = backend.load_weight(raw, qtype, n_out, n_in)
    copies = max(1, -(-STREAM_BYTES // first.nbytes))
    return [first] + [backend.load_weight(raw, qtype, n_out, n_in) for _ in range(copies - 1)]


def product_time(backend, ws: list, n: int, settings: dict) -> float:
    """Seconds of the products of n random tokens with every weight in ws, with the backend's
    dispatch as in `settings` (the activation quantized once, outside the timing)."""
    import cupy as cp

    w0 = ws[0]
    x = cp.asarray(np.random.default_rng(n).standard_normal((n, w0.n_in)), cp.float32)
    y = cp.empty((n, w0.n_out), cp.float32)
    with dispatch(**settings):
        act = backend._quantize(x, w0.per_256)

        def run():
            for w in ws:
                backend._product(x, act, w, y)

        return event_time(run, repeat=10)


def part_time(backend) -> None:
    import cupy as cp

    rows = []
    for qtype in ("Q4_0", "Q4_K"):
        for n_out, n_in in SHAPES_7B:
            ws = weight_copies(backend, qtype, n_out, n_in)
            total = sum(w.nbytes for w in ws)
            per = {}
            for n in TOKENS:
                per[n] = {
                    k: product_time(backend, ws, n, s) for k, s in (("old", OLD), ("new", {}))
                }
            line = []
            for n in TOKENS:
                old, new = per[n]["old"], per[n]["new"]
                row = {"type": qtype, "shape": f"{n_out}x{n_in}", "n": n,
                       "old_GBs": total / old / 1e9, "new_GBs": total / new / 1e9,
                       "old_vs_n1": old / per[1]["old"], "new_vs_n1": new / per[1]["new"],
                       "new_vs_old_n1": new / per[1]["old"]}  # fmt: skip
                rows.append(row)
                line.append(
                    f"n={n}: {row['old_GBs']:5.0f}/{row['new_GBs']:5.0f} GB/s "
                    f"x{row['old_vs_n1']:.2f}/x{row['new_vs_n1']:.2f}"
                )
            log(f"{qtype} {n_out}x{n_in} (old/new, time over n=1's): " + "  ".join(line))
            del ws
            cp.get_default_memory_pool().free_all_blocks()
    results["time"] = rows


# -- sweep --------------------------------------------------------------------------------------


def sweep_module(formats):
    import cupy as cp

    from fastrun.backends.cuda.backend import SOURCES

    names = [
        f"matvec_tile<{f}, {r}, {t}, {u}>"
        for f in formats
        for t, shapes in SWEEP_TILES.items()
        for r, u in shapes
    ]
    options = ("-std=c++17", f"-I{SOURCES}", "-DMV_ROWS=1", "-DMV_UNROLL1=4")
    module = cp.RawModule(
        code=(SOURCES / "matmul.cu").read_text(), options=options, name_expressions=names
    )
    return module


def time_tile(kernel, launch: tuple, ws: list, act: tuple, expect, n: int) -> tuple:
    """(whether its result for ws[0] equals `expect` bit for bit, seconds over all of ws) of a
    matvec_tile kernel launched as `launch` (grid, block, shared, stage: tile_launch's)."""
    import cupy as cp

    grid, block, shared, stage = launch
    y = cp.empty_like(expect)
    i32 = np.int32

    def run(w_list=ws):
        for w in w_list:
            args = (*w.plane_args(), *act, y, i32(w.n_in), i32(w.n_out), i32(n), i32(0))
            kernel(grid, block, (*args, i32(stage)), shared_mem=shared)

    run(ws[:1])
    same = bool(cp.array_equal(y, expect))
    return same, event_time(run, repeat=5)


def part_sweep(backend) -> None:
    import cupy as cp

    from fastrun.backends.cuda.backend import tile_launch

    t0 = time.perf_counter()
    formats = {"Q4_0": "FmtQ4_0", "Q4_K": "FmtQ4_K"}
    module = sweep_module(formats.values())
    optin = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    found = []
    for qtype in formats:
        for n_out, n_in in SWEEP_SHAPES:
            ws = weight_copies(backend, qtype, n_out, n_in)
            total = sum(w.nbytes for w in ws)
            for n in TOKENS:
                bucket = 1 << (n - 1).bit_length()
                x = cp.asarray(np.random.default_rng(n).standard_normal((n, n_in)), cp.float32)
                with dispatch(**MATVEC_ONLY):
                    act = backend._quantize(x, ws[0].per_256)
                    expect = cp.empty((n, n_out), cp.float32)
                    backend._product(x, act, ws[0], expect)
                timings = []
                for rows, unroll in SWEEP_TILES[bucket]:
                    for warps in SWEEP_WARPS:
                        for stage_max in (0, optin):
                            launch = tile_launch(ws[0], n, (bucket, rows, unroll), warps, stage_max)
                            if stage_max and not launch[4]:
                                continue  # too large to stage
                            kernel = module.get_function(launch[0])
                            kernel.max_dynamic_shared_size_bytes = optin
                            same, seconds = time_tile(kernel, launch[1:], ws, act, expect, n)
                            timings.append(
                                {
                                    "type": qtype,
                                    "shape": f"{n_out}x{n_in}",
                                    "n": n,
                                    "tile": f"{bucket}:{rows}:{unroll}",
                                    "warps": warps,
                                    "stage": launch[4],
                                    "GBs": total / seconds / 1e9,
                                    "seconds": seconds,
                                    "bit_identical": same,
                                }
                            )
                timings.sort(key=lambda r: r["seconds"])
                found += timings
                best = ", ".join(
                    f"{r['tile']} w{r['warps']} s{int(r['stage'])} {r['GBs']:.0f}"
                    for r in timings[:4]
                )
                wrong = [r for r in timings if not r["bit_identical"]]
                matvec = total / product_time(backend, ws, n, MATVEC_ONLY) / 1e9
                log(f"sweep {qtype} {n_out}x{n_in} n={n}: best {best} GB/s; matvec_q {matvec:.0f}"
                    + (f"; NOT bit-identical: {len(wrong)}" if wrong else ""))  # fmt: skip
            del ws
            cp.get_default_memory_pool().free_all_blocks()
    results["sweep"] = found
    # per bucket: the shape (tile, warps, stage) with the least time summed over types, shapes
    # and the token counts of the bucket
    summed: dict = {}
    for r in found:
        key = (1 << (r["n"] - 1).bit_length(), r["tile"], r["warps"], r["stage"])
        summed[key] = summed.get(key, 0.0) + r["seconds"]
    best = {}
    for (bucket, tile, warps, stage), s in summed.items():
        if bucket not in best or s < best[bucket][0]:
            best[bucket] = (s, tile, warps, stage)
    for bucket, (_, tile, warps, stage) in sorted(best.items()):
        log(f"sweep best for {bucket} tokens: tile {tile}, {warps} warps, staged {stage}")
    log(f"sweep took {time.perf_counter() - t0:.0f} s")
    results["sweep_best"] = {str(b): v[1:] for b, v in best.items()}


# -- verify / tg (subprocesses) ----------------------------------------------------------------


def run_script(label: str, cmd: list[str], env: dict, timeout: float) -> str:
    log(f"{label}: {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}")
    try:
        done = subprocess.run(
            [sys.executable, *cmd], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        log(f"{label}: timed out after {timeout:.0f} s")
        print(out[-3000:], flush=True)
        return out
    for line in done.stdout.splitlines():
        print(f"    {line}", flush=True)
    if done.returncode:
        log(f"{label}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return done.stdout


VERIFY_RUNS = (
    ("new", {}),
    ("old", OLD_ENV),
    ("new, attention splits as before", {"FASTRUN_ATTN_FEW_BLOCKS": "256"}),
)


def part_verify(deadline: float) -> None:
    cmd = ["scripts/spec_bench.py", "--verify-cost", "--backend", "cuda", "--shape", "llama2-7b"]
    out = {}
    for label, env in VERIFY_RUNS:
        left = deadline - time.perf_counter()
        if left < 60:
            log(f"verify {label}: skipped, {left:.0f} s left")
            continue
        text = run_script(f"verify {label}", cmd, env, min(left, 150))
        out[label] = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    results["verify"] = out
    for label, rows in out.items():
        log(f"verify {label}: " + " ".join(f"{r['tokens']}:{r['vs_decode_step']}" for r in rows))


def part_tg(deadline: float) -> None:
    cmd = ["scripts/gpu_bench.py", "--shapes", "llama2-7b", "--types", "Q4_0", "--no-torch"]
    out = {}
    for label, env in (("new", {}), ("old", OLD_ENV)):
        left = deadline - time.perf_counter()
        if left < 90:
            log(f"tg {label}: skipped, {left:.0f} s left")
            continue
        out[label] = run_script(f"tg {label}", cmd, env, min(left, 200))[-1500:]
    results["tg"] = out


PARTS = ("correct", "time", "verify", "sweep", "tg")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--budget", type=float, default=460, help="seconds for all parts")
    ap.add_argument("--json", type=Path, help="write the results here (after every part)")
    args = ap.parse_args()
    deadline = started + args.budget
    backend = None
    failed = []
    for part in args.parts.split(","):
        left = deadline - time.perf_counter()
        if left < 20:
            log(f"{part}: skipped, {left:.0f} s left")
            continue
        log(f"== {part} ==")
        try:
            if part in ("verify", "tg"):
                {"verify": part_verify, "tg": part_tg}[part](deadline)
            else:
                if backend is None:
                    from fastrun.backends.cuda.backend import CUDABackend

                    backend = CUDABackend()
                {"correct": part_correct, "time": part_time, "sweep": part_sweep}[part](backend)
        except Exception:
            failed.append(part)
            log(f"{part} FAILED:\n{traceback.format_exc()}")
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
    log(f"done; failed parts: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
