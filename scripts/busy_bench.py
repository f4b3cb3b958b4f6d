#!/usr/bin/env python3
"""Decode speed while another process keeps one core busy: fastrun on 1 thread, on every core,
and adaptive (no --threads), against llama-bench on 1 thread and on every core.

    python scripts/busy_bench.py smollm2-135m-instruct --llama-bench /path/to/llama-bench
    python scripts/busy_bench.py smollm2-135m-instruct --quiet     # no spinner: adaptive's cost
    python scripts/busy_bench.py smollm2-135m-instruct --midway    # spinner starts mid-generation

The spinner is a Python busy loop pinned to the last allowed core, started before each
measurement and stopped after it. Each tool is measured as `bench -p 0 -n 64` (tg64), the
fixed counts and adaptive alternating for --rounds rounds; the table shows medians and the
ratios the targets name (adaptive / best fixed count, adaptive / llama.cpp's best).
--midway times one 256-token generation per thread setting, the spinner started after the
first 128 tokens, and reports the tokens per second of each half.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

SPIN = "import os; os.sched_setaffinity(0, {%d})\nwhile True: pass"


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@contextlib.contextmanager
def spinner(on: bool):
    """A process spinning on the last core while the block runs (nothing when not on)."""
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", SPIN % cores()[-1]])
    time.sleep(0.3)  # running before the measurement starts
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def fastrun_tg(model: str, n: int, reps: int, threads: int | None) -> float:
    cmd = [sys.executable, "-m", "fastrun.runner.cli", "bench", model, "-p", "0", "-n", str(n),
           "-r", str(reps), "--backend", "cpu", "--json"]  # fmt: skip
    if threads:
        cmd += ["-t", str(threads)]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return out["results"][0]["mean"]


def llama_tg(binary: str, path: str, n: int, reps: int, threads: int) -> float:
    cmd = [binary, "-m", path, "-t", str(threads), "-p", "0", "-n", str(n), "-r", str(reps),
           "-o", "json"]  # fmt: skip
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return rows[0]["avg_ts"]


def steady(args, busy: bool) -> None:
    from fastrun.runner.registry import resolve_model

    most = len(cores())
    fixed = sorted({1, most})
    runs = {f"fastrun -t {t}": (fastrun_tg, args.model, t) for t in fixed}
    runs["fastrun auto"] = (fastrun_tg, args.model, None)
    if args.llama_bench:
        path = str(resolve_model(args.model))
        for t in fixed:
            runs[f"llama.cpp -t {t}"] = (
                lambda _model, n, reps, t, path=path: llama_tg(args.llama_bench, path, n, reps, t),
                args.model, t,
            )  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (fn, model, threads) in runs.items():
            with spinner(busy):
                rates[name].append(fn(model, args.n, args.reps, threads))
            print(f"{name}: {rates[name][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    median = {name: statistics.median(v) for name, v in rates.items()}
    load = "one core busy (spinner)" if busy else "no spinner"
    print(f"{args.model}, tg{args.n}, {load}, load average before: {args.load_before}")
    print("| run | tok/s (median) | rounds |")
    print("| --- | --- | --- |")
    for name, value in median.items():
        print(f"| {name} | {value:.1f} | {' '.join(f'{v:.1f}' for v in rates[name])} |")
    auto = median["fastrun auto"]
    best_fixed = max(median[f"fastrun -t {t}"] for t in fixed)
    print(f"\nadaptive / best fixed fastrun: {auto / best_fixed:.2f}")
    if args.llama_bench:
        for t in fixed:
            print(f"adaptive / llama.cpp -t {t}: {auto / median[f'llama.cpp -t {t}']:.2f}")


def midway(args) -> None:
    """One generation per thread setting; the spinner starts halfway through it."""
    import numpy as np

    from fastrun.runner.api import Model
    from fastrun.runner.registry import resolve_model

    path = resolve_model(args.model)
    half = args.n_midway // 2
    print(f"{args.model}: {2 * half} tokens, spinner from token {half} on")
    print("| threads | tok/s before | tok/s after |")
    print("| --- | --- | --- |")
    for threads in sorted({1, len(cores())}) + [None]:
        model = Model(path, backend="cpu", n_ctx=2 * half + 8, threads=threads)

        def generate(model=model):
            tf = model.transformer
            cache = tf.new_cache(2 * half + 4)
            token, stamps = 1, []
            for _ in range(8):  # warm-up, then from an empty cache
                token = int(tf.forward([token], cache, top_k=1)[0][-1, 0])
            cache.trim(0)
            proc = None
            try:
                for i in range(2 * half):
                    if i == half:
                        proc = subprocess.Popen([sys.executable, "-c", SPIN % cores()[-1]])
                    token = int(tf.forward([token], cache, top_k=1)[0][-1, 0])
                    stamps.append(time.perf_counter())
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
            cache.free()
            return np.diff(stamps)

        steps = model.engine.call(generate)
        model.close()
        before, after = half / steps[: half - 1].sum(), half / steps[half:].sum()
        print(f"| {threads or 'auto'} | {before:.1f} | {after:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--llama-bench", help="llama-bench binary (else llama.cpp is skipped)")
    parser.add_argument("--quiet", action="store_true", help="no spinner")
    parser.add_argument("--midway", action="store_true", help="spinner from mid-generation")
    parser.add_argument("-n", type=int, default=64, help="tokens per tg test")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per bench call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-midway", type=int, default=256)
    args = parser.parse_args()
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.midway:
        midway(args)
    else:
        steady(args, busy=not args.quiet)


if __name__ == "__main__":
    main()
