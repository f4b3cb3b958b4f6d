#!/usr/bin/env python3
"""fastrun against native llama.cpp (llama-bench) on the same models, in one run.

    python scripts/bench_vs_llamacpp.py --llama-bench /path/to/llama-bench \\
        smollm2-135m-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct

Build llama-bench from the llama.cpp sources vendored in the llama-cpp-python sdist
(`pip download --no-binary :all: --no-deps llama-cpp-python`, unpack, then
`cmake -S vendor/llama.cpp -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release` and
`cmake --build build --target llama-bench -j 2`). For benchmarking only, never in CI.

Each model is measured by both tools back to back, `--rounds` times alternating, and the
median of the rounds is reported with the ratio fastrun / llama.cpp. `-d 2048` runs each test
after 2,048 cached tokens in both tools (llama-bench's -d).

    python scripts/bench_vs_llamacpp.py --parallel 1,8 \\
        --batched-bench /path/to/llama-batched-bench -p 16 -n 64 \\
        smollm2-135m-instruct qwen2.5-coder-0.5b-instruct

compares parallel sequences instead: `fastrun bench --parallel` (through the engine's batcher)
against `llama-batched-bench -npp P -ntg N -npl ...` built from the same sources: aggregate
decode (S_TG) and overall (S) tokens per second per number of sequences.

`--isa avx2` runs fastrun's kernels for another instruction set on this machine: Numba
compiles for the host's features less AVX-512 and AVX-VNNI (NUMBA_CPU_FEATURES, which
backends/cpu/simd.py follows). `--isa avx-vnni` keeps AVX-VNNI where the host has it;
`--isa portable` is avx2 with FASTRUN_PORTABLE's generic vector code in place of the x86
intrinsics (the path of ARM and other hosts). Each has a kernel cache of its own. Pair them
with a llama-bench built for the same set (`-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_BMI2=ON`, and `-DGGML_AVX_VNNI=ON` for avx-vnni).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def isa_environment(isa: str) -> dict[str, str]:
    """Environment variables that make fastrun's kernels those of `isa` on this host."""
    if isa == "native":
        return {}
    cache = os.path.join(os.path.expanduser("~/.cache/fastrun"), f"numba-{isa}")
    from llvmlite import binding

    wider = ("+avx512", "+avx10", "+amx", "+avxifma", "+avxneconvert")
    if isa != "avx-vnni":
        wider += ("+avxvnni",)
    features = [
        "-" + f[1:] if f.startswith(wider) else f
        for f in binding.get_host_cpu_features().flatten().split(",")
    ]
    if "+avx2" not in features:
        raise SystemExit(f"--isa {isa}: this host has no AVX2")
    env = {"NUMBA_CPU_FEATURES": ",".join(features), "NUMBA_CACHE_DIR": cache}
    if isa == "portable":
        env["FASTRUN_PORTABLE"] = "1"
    return env


def test_name(kind: str, n: int, depth: int) -> str:
    """llama-bench's name of a test: pp256, tg64, tg64 @ d2048."""
    return f"{kind}{n}" + (f" @ d{depth}" if depth else "")


def fastrun_bench(model: str, p: int, n: int, r: int, threads: int, d: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "fastrun.runner.cli", "bench", model, "-p", str(p), "-n", str(n),
           "-r", str(r), "-t", str(threads), "-d", str(d), "--json"]  # fmt: skip
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {row["test"]: row["mean"] for row in out["results"]}


def llama_bench(binary: str, path: str, p: int, n: int, r: int, threads: int, d: int) -> dict:
    cmd = [binary, "-m", path, "-t", str(threads), "-p", str(p), "-n", str(n), "-r", str(r),
           "-o", "json"] + (["-d", str(d)] if d else [])  # fmt: skip
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    result = {}
    for row in rows:
        kind, count = ("pp", row["n_prompt"]) if row["n_prompt"] else ("tg", row["n_gen"])
        result[test_name(kind, count, row.get("n_depth", 0))] = row["avg_ts"]
    return result


def fastrun_parallel(model: str, counts: str, p: int, n: int, r: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "fastrun.runner.cli", "bench", model, "--parallel", counts,
           "-p", str(p), "-n", str(n), "-r", str(r), "-t", str(threads), "--json"]  # fmt: skip
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {row["npl"]: (row["s_tg"], row["s"]) for row in out["results"]}


def batched_bench(binary: str, path: str, counts: str, p: int, n: int, threads: int) -> dict:
    """llama-batched-bench's table rows: npl -> (S_TG, S)."""
    most = max(int(c) for c in counts.split(","))
    cmd = [binary, "-m", path, "-t", str(threads), "-c", str(most * (p + n) + 64), "-npp", str(p),
           "-ntg", str(n), "-npl", counts]  # fmt: skip
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():  # PP TG B N_KV T_PP S_PP T_TG S_TG T S
            result[int(cells[2])] = (float(cells[7]), float(cells[9]))
    return result


def compare_parallel(args) -> None:
    from fastrun.runner.registry import resolve_model

    lines = [
        "| model | sequences | fastrun S_TG | llama.cpp S_TG | ratio | fastrun S | llama.cpp S "
        "| ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model in args.models:
        path = str(resolve_model(model))
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(
                fastrun_parallel(model, args.parallel, args.p, args.n, args.r, args.threads)
            )
            theirs.append(
                batched_bench(args.batched_bench, path, args.parallel, args.p, args.n, args.threads)
            )
        for npl in sorted(ours[0]):
            a_tg = statistics.median(o[npl][0] for o in ours)
            b_tg = statistics.median(t[npl][0] for t in theirs)
            a_s = statistics.median(o[npl][1] for o in ours)
            b_s = statistics.median(t[npl][1] for t in theirs)
            lines.append(
                f"| {model} | {npl} | {a_tg:.1f} | {b_tg:.1f} | {a_tg / b_tg:.2f} | {a_s:.1f} | "
                f"{b_s:.1f} | {a_s / b_s:.2f} |"
            )
        print("\n".join(lines), flush=True)
        print()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("models", nargs="+", help="registry names or GGUF paths")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH", "llama-bench"))
    ap.add_argument("-p", type=int, default=256)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument(
        "-d", type=int, default=0, help="cached tokens before each test (llama-bench -d)"
    )
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per model")
    ap.add_argument("--isa", choices=("native", "avx-vnni", "avx2", "portable"), default="native")
    ap.add_argument("--parallel", help="e.g. 1,8: parallel sequences against llama-batched-bench")
    ap.add_argument(
        "--batched-bench", default=os.environ.get("LLAMA_BATCHED_BENCH", "llama-batched-bench")
    )
    args = ap.parse_args()
    os.environ.update(isa_environment(args.isa))  # for the fastrun subprocesses
    if args.parallel:
        compare_parallel(args)
        return

    from fastrun.runner.registry import resolve_model

    lines = [
        "| model | test | fastrun t/s | llama.cpp t/s | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for model in args.models:
        path = str(resolve_model(model))
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(fastrun_bench(model, args.p, args.n, args.r, args.threads, args.d))
            theirs.append(
                llama_bench(args.llama_bench, path, args.p, args.n, args.r, args.threads, args.d)
            )
        tests = [test_name(k, n, args.d) for k, n in (("pp", args.p), ("tg", args.n)) if n > 0]
        for test in tests:
            a = statistics.median(o[test] for o in ours)
            b = statistics.median(t[test] for t in theirs)
            lines.append(f"| {model} | {test} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
        print("\n".join(lines), flush=True)
        print()


if __name__ == "__main__":
    main()
