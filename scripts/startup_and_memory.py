#!/usr/bin/env python3
"""Time from `fastrun run` to the first token, cold (empty kernel cache) and warm, and the peak
resident memory of a run, against the model file's size.

    python scripts/startup_and_memory.py smollm2-135m-instruct [qwen2.5-coder-1.5b-instruct ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def timed_run(model: str, cache_dir: str, n: int = 1, ctx: int = 512) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one `fastrun run` process generating n tokens."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    code = (
        "import resource, subprocess, sys, time;"
        "t = time.perf_counter();"
        f"subprocess.run([sys.executable, '-m', 'fastrun.runner.cli', 'run', {model!r}, 'Hello',"
        f" '-n', '{n}', '-c', '{ctx}', '--temp', '0'], check=True, capture_output=True);"
        "dt = time.perf_counter() - t;"
        "print(dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    seconds, rss = out.stdout.split()
    return float(seconds), float(rss)


def main() -> None:
    from fastrun.runner.registry import resolve_model

    print("| model | file MB | cold first token s | warm first token s | peak RSS MB |")
    print("| --- | --- | --- | --- | --- |")
    for model in sys.argv[1:] or ["smollm2-135m-instruct"]:
        size = os.path.getsize(resolve_model(model)) / 1e6
        with tempfile.TemporaryDirectory() as cache:
            cold, _ = timed_run(model, cache)
            warm = min(timed_run(model, cache)[0] for _ in range(3))
            _, rss = timed_run(model, cache, n=64)
        print(f"| {model} | {size:.0f} | {cold:.1f} | {warm:.2f} | {rss:.0f} |", flush=True)


if __name__ == "__main__":
    main()
