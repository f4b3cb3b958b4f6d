#!/usr/bin/env python3
"""The CUDA products of a few tokens (matvec_tile, matmul_exact, matmul.cu) checked and timed
on the device in one call: each part prints as it goes and a failure in one does not stop the
others.

    python scripts/gpu_kernel_check.py                       # every part, about 6-8 minutes
    python scripts/gpu_kernel_check.py --parts correct,time --json $OUT/check.json

Parts:
  correct  every weight format, 1..16 tokens: the default dispatch, matmul_exact, matvec_tile,
           matmul_chains and matmul_few against the NumPy reference (max abs error over max
           |reference|; the parity tests allow 1e-4), and matmul_exact, matvec_tile (staged and
           unstaged activations), matmul_chains (up to 8) and the default (where exact) bit for
           bit against the dp4a matvec (matvec_q)
  time     the 7B-shaped products (n_out x n_in: 4096x4096, 11008x4096, 4096x11008, 32000x4096)
           for Q4_0 and Q4_K at 1, 2, 4, 8, 9, 16 tokens: old dispatch (dp4a matvec up to 4
           tokens, tensor cores above) / matvec_tile for 2..16 / matmul_exact for 2..16, in
           GB/s of weights and time over the old n=1's
  verify   scripts/spec_bench.py --verify-cost --shape llama2-7b: default, old, matmul_exact
           from 5 tokens and from 2 (each a subprocess, ~15 s)
  sweep    matvec_tile's shapes (tokens a block:rows a warp:groups in flight, warps a block,
           staged or not) and matmul_few's (groups in flight, warps) on the 11008x4096 product;
           the best per bucket of tokens (FASTRUN_SMALL_TILES, FASTRUN_SMALL_WARPS,
           FASTRUN_SMALL_STAGE; FASTRUN_MATVEC1_TILE for one token)
  tg       scripts/gpu_bench.py on the 7B Q4_0 and Q4_K shapes (pp512, tg128 at depth 512,
           batch 1 and 16)

The old dispatch is FASTRUN_SMALL_BATCH=0 FASTRUN_EXACT_BATCH=0 FASTRUN_CHAINS=0,0
FASTRUN_MMA_ONE_FRAGMENT=0 FASTRUN_GRAPH_EXACT=0 FASTRUN_ATTN_FEW_BLOCKS=256.
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

OLD_ENV = {
    "FASTRUN_SMALL_BATCH": "0",
    "FASTRUN_EXACT_BATCH": "0",
    "FASTRUN_CHAINS": "0,0",
    "FASTRUN_MMA_ONE_FRAGMENT": "0",
    "FASTRUN_GRAPH_EXACT": "0",
    "FASTRUN_ATTN_FEW_BLOCKS": "256",
}
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
FEW_UNROLLS = (4, 8)  # matmul_few's groups in flight a lane
SWEEP_SHAPES = ((11008, 4096),)

started = time.perf_counter()
deadline = started + 460.0  # main() sets it from --budget
results: dict = {}


def out_of_time(what: str) -> bool:
    if time.perf_counter() < deadline:
        return False
    log(f"{what}: out of time, the rest skipped")
    return True


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


OLD = dict(SMALL_BATCH=0, EXACT_BATCH=0, CHAINS=(0, 0))  # in-process: the old split
TILE = dict(SMALL_BATCH=16, EXACT_BATCH=0, CHAINS=(0, 0))  # matvec_tile for 2..16
EXACT = dict(SMALL_BATCH=0, EXACT_BATCH=16)  # matmul_exact for 2..16
TIMED = (("old", OLD), ("tile", TILE), ("exact", EXACT))
MATVEC_ONLY = dict(SMALL_BATCH=0, EXACT_BATCH=0, CHAINS=(0, 0), MATVEC_BATCH=16)  # matvec_q
CHAINS = dict(SMALL_BATCH=0, EXACT_BATCH=0, CHAINS=(2, 8))  # matmul_chains for 2..8


# -- correct ------------------------------------------------------------------------------------


def part_correct(backend) -> None:
    import cupy as cp
    from helpers import random_blocks

    import fastrun.backends.cuda.backend as cb
    from fastrun.backends.cuda.weights import KERNEL_FORMATS
    from fastrun.backends.reference import ReferenceBackend

    ref = ReferenceBackend()
    rng = np.random.default_rng(0)
    worst, few_worst, unequal = 0.0, 0.0, []
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
                with dispatch(**EXACT):
                    got["exact"] = cp.asnumpy(backend.matmul(xd, w))
                with dispatch(**TILE):
                    got["tile"] = cp.asnumpy(backend.matmul(xd, w))
                with dispatch(**TILE, SMALL_STAGE=0):
                    got["unstaged"] = cp.asnumpy(backend.matmul(xd, w))
                with dispatch(**MATVEC_ONLY):
                    got["matvec_q"] = cp.asnumpy(backend.matmul(xd, w))
                with dispatch(**OLD):
                    got["old"] = cp.asnumpy(backend.matmul(xd, w))
                with dispatch(**CHAINS):
                    got["chains"] = cp.asnumpy(backend.matmul(xd, w))
                with dispatch(EXACT_BATCH=0, CHAINS=(0, 0), FEW_MMA_FROM=2):
                    got["few_mma"] = cp.asnumpy(backend.matmul(xd, w))
                scale = float(np.abs(expect).max())
                err = {k: float(np.abs(v - expect).max()) / scale for k, v in got.items()}
                errs.append(err["new"])
                few_worst = max(few_worst, err["few_mma"])
                worst = max(worst, err["new"], err["unstaged"], err["tile"], err["exact"])
                worst = max(worst, err["chains"])
                exact_new = n <= max(cb.SMALL_BATCH, cb.CHAINS[1])  # the default's exact sizes
                for k in (
                    ("exact", "tile", "unstaged") + ("chains",) * (n <= 8) + ("new",) * exact_new
                ):
                    if not np.array_equal(got["matvec_q"], got[k]):
                        unequal.append((qtype, n_in, n, k))
                if max(err["new"], err["unstaged"], err["few_mma"]) > 1e-4:
                    log(f"  FAIL {qtype} {n_out}x{n_in} n={n}: {err}")
            log(f"{qtype:5s} {n_out}x{n_in}: new rel err max {max(errs):.2e} over n=1..16")
    results["correct"] = {
        "worst_rel_err": worst, "few_mma_worst_rel_err": few_worst, "not_bit_identical": unequal
    }  # fmt: skip
    log(f"correct: worst rel err {worst:.2e}, matmul_few's {few_worst:.2e} (parity: 1e-4)")
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

        return event_time(run, repeat=7)


def part_time(backend) -> None:
    import cupy as cp

    rows = []
    for qtype in ("Q4_0", "Q4_K"):
        for n_out, n_in in SHAPES_7B:
            if out_of_time("time"):
                break
            ws = weight_copies(backend, qtype, n_out, n_in)
            total = sum(w.nbytes for w in ws)
            per = {n: {k: product_time(backend, ws, n, s) for k, s in TIMED} for n in TOKENS}
            line = []
            for n in TOKENS:
                row = {"type": qtype, "shape": f"{n_out}x{n_in}", "n": n}
                for k, _ in TIMED:
                    row[f"{k}_GBs"] = total / per[n][k] / 1e9
                    row[f"{k}_vs_n1"] = per[n][k] / per[1]["old"]
                rows.append(row)
                line.append(
                    f"n={n}: " + "/".join(f"{row[f'{k}_GBs']:4.0f}" for k, _ in TIMED) + " GB/s x"
                    + "/x".join(f"{row[f'{k}_vs_n1']:.2f}" for k, _ in TIMED)
                )  # fmt: skip
            log(f"{qtype} {n_out}x{n_in} ({'/'.join(k for k, _ in TIMED)}, time over n=1's):")
            for text in line:
                log("    " + text)
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
    names += [f"matmul_few<{f}, {nf}, {u}>" for f in formats for nf in (1, 2) for u in FEW_UNROLLS]
    options = ("-std=c++17", f"-I{SOURCES}", "-DMV_ROWS=1", "-DMV_UNROLL1=4")
    module = cp.RawModule(
        code=(SOURCES / "matmul.cu").read_text(), options=options, name_expressions=names
    )
    return module


def time_kernel(kernel, launch: tuple, tail: tuple, ws: list, act: tuple, expect, n: int):
    """(max |difference| over max |expect| of its result for ws[0], seconds over all of ws)
    of a product kernel launched as `launch` (grid, block, shared bytes) with the arguments
    of matvec_q and then `tail`."""
    import cupy as cp

    grid, block, shared = launch
    y = cp.empty_like(expect)
    i32 = np.int32

    def run(w_list=ws):
        for w in w_list:
            args = (*w.plane_args(), *act, y, i32(w.n_in), i32(w.n_out), i32(n), i32(0))
            kernel(grid, block, (*args, *tail), shared_mem=shared)

    run(ws[:1])
    diff = float(cp.abs(y - expect).max() / cp.abs(expect).max())
    return diff, event_time(run, repeat=3)


def sweep_point(backend, module, ws: list, n: int) -> list[dict]:
    """Every matvec_tile shape (SWEEP_TILES x SWEEP_WARPS, staged or not) and matmul_few's
    (FEW_UNROLLS x SWEEP_WARPS) for n tokens over the weights ws, fastest first."""
    import cupy as cp

    from fastrun.backends.cuda.backend import few_mma_launch, tile_launch

    w0 = ws[0]
    optin = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    total = sum(w.nbytes for w in ws)
    bucket = 1 << (n - 1).bit_length()
    x = cp.asarray(np.random.default_rng(n).standard_normal((n, w0.n_in)), cp.float32)
    with dispatch(**MATVEC_ONLY):
        act = backend._quantize(x, w0.per_256)
        expect = cp.empty((n, w0.n_out), cp.float32)
        backend._product(x, act, w0, expect)
    tiled = backend._quantize(x, w0.per_256, tiled=True)
    runs = []  # (kernel, shape, warps, stage, launch, extra arguments, activation)
    for rows, unroll in SWEEP_TILES[bucket]:
        for warps in SWEEP_WARPS:
            for stage_max in (0, optin):
                name, grid, block, shared, stage = tile_launch(
                    w0, n, (bucket, rows, unroll), warps, stage_max
                )
                if stage_max == 0 or stage:  # (else too large to stage)
                    shape = f"{bucket}:{rows}:{unroll}"
                    launch, tail = (name, grid, block, shared), (np.int32(stage),)
                    runs.append(("tile", shape, warps, stage, launch, tail, act))
    for unroll in FEW_UNROLLS if n > 1 else ():
        for warps in SWEEP_WARPS:
            name, grid, block = few_mma_launch(w0, n, warps, unroll)
            runs.append(("few_mma", f"u{unroll}", warps, False, (name, grid, block, 0), (), tiled))
    timings = []
    for kernel_name, shape, warps, stage, (name, *launch), tail, activation in runs:
        kernel = module.get_function(name)
        if kernel_name == "tile":  # (matmul_few's shared memory is static)
            kernel.max_dynamic_shared_size_bytes = optin
        diff, seconds = time_kernel(kernel, launch, tail, ws, activation, expect, n)
        timings.append(
            {
                "shape": f"{w0.n_out}x{w0.n_in}",
                "n": n,
                "kernel": kernel_name,
                "tile": shape,
                "warps": warps,
                "stage": stage,
                "GBs": total / seconds / 1e9,
                "seconds": seconds,
                "diff": diff,
                "bit_identical": diff == 0.0,
            }  # fmt: skip
        )
    timings.sort(key=lambda r: r["seconds"])
    timings.append({"n": n, "kernel": "matvec_q", "tile": "-", "warps": 8, "stage": False,
                    "GBs": total / product_time(backend, ws, n, MATVEC_ONLY) / 1e9})  # fmt: skip
    return timings


def part_sweep(backend) -> None:
    import cupy as cp

    t0 = time.perf_counter()
    formats = {"Q4_0": "FmtQ4_0", "Q4_K": "FmtQ4_K"}
    module = sweep_module(formats.values())
    found = []
    for qtype in formats:
        for n_out, n_in in SWEEP_SHAPES:
            ws = weight_copies(backend, qtype, n_out, n_in)
            for n in TOKENS:
                if out_of_time("sweep"):
                    break
                timings = sweep_point(backend, module, ws, n)
                for r in timings:
                    r["type"] = qtype
                found += timings
                best = ", ".join(
                    f"{r['kernel']} {r['tile']} w{r['warps']} s{int(r['stage'])} {r['GBs']:.0f}"
                    for r in timings[:4]
                )
                measured = [r for r in timings if "diff" in r]
                wrong = [r for r in measured if r["kernel"] == "tile" and not r["bit_identical"]]
                wrong += [r for r in measured if r["diff"] > 1e-4]
                log(f"sweep {qtype} {n_out}x{n_in} n={n}: best {best} GB/s; "
                    f"matvec_q {timings[-1]['GBs']:.0f}"
                    + (f"; WRONG: {len(wrong)} {wrong[:3]}" if wrong else ""))  # fmt: skip
            del ws
            cp.get_default_memory_pool().free_all_blocks()
    results["sweep"] = found
    # per bucket: the kernel and shape with the least time summed over types, shapes and the
    # token counts of the bucket
    summed: dict = {}
    for r in found:
        if "diff" in r:
            key = (1 << (r["n"] - 1).bit_length(), r["kernel"], r["tile"], r["warps"], r["stage"])
            summed[key] = summed.get(key, 0.0) + r["seconds"]
    best = {}
    for (bucket, kernel, tile, warps, stage), seconds in summed.items():
        if bucket not in best or seconds < best[bucket][0]:
            best[bucket] = (seconds, kernel, tile, warps, stage)
    for bucket, (_, kernel, tile, warps, stage) in sorted(best.items()):
        log(f"sweep best for {bucket} tokens: {kernel} {tile}, {warps} warps, staged {stage}")
    tiles = [f"{tile}:{warps}" for b, (_, k, tile, warps, _) in sorted(best.items()) if b > 1]
    if all(k == "tile" for b, (_, k, *_) in best.items() if b > 1):
        log(f"sweep: FASTRUN_SMALL_TILES={','.join(tiles)}")
    else:
        few = min(b for b, (_, k, *_) in best.items() if k == "few_mma")
        log(f"sweep: tensor cores best from the {few}-token bucket: FASTRUN_FEW_MMA_FROM=...")
    if 1 in best:  # one token: the best tile against matvec_q's
        one = min((r for r in found if r["n"] == 1 and "diff" in r), key=lambda r: r["seconds"])
        matvec = [r["GBs"] for r in found if r["n"] == 1 and r["kernel"] == "matvec_q"]
        rows, unroll = one["tile"].split(":")[1:]
        setting = f"FASTRUN_MATVEC1_TILE={rows}:{unroll}:{one['warps']}"
        log(f"sweep: one token, best tile {one['GBs']:.0f} GB/s against matvec_q's {matvec}: "
            f"{setting}, staged {one['stage']}")  # fmt: skip
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
    ("exact from 5 tokens", {"FASTRUN_EXACT_BATCH": "16"}),
    ("exact from 2 tokens", {"FASTRUN_SMALL_BATCH": "0", "FASTRUN_EXACT_BATCH": "16"}),
)


def part_verify() -> None:
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
        log(f"verify {label}: " + " ".join(f"{r['tokens']}:{r['vs_1_tokens']}" for r in rows))


TG_RUNS = (("new", {}),)  # FASTRUN_EXACT_BATCH=16: batch 16 through matmul_exact, slower


def part_tg() -> None:
    cmd = ["scripts/gpu_bench.py", "--shapes", "llama2-7b", "--types", "Q4_0", "Q4_K"]
    cmd += ["--no-torch", "-n", "128", "--batch", "16"]
    out = {}
    for label, env in TG_RUNS:
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
    global deadline
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
                {"verify": part_verify, "tg": part_tg}[part]()
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
