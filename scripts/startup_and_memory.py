#!/usr/bin/env python3
"""Time from `fastrun run` to the first token, cold (empty kernel and tile caches), warm (both
filled) and warm without the tile cache (repacking at every load), and the peak resident
memory of a run, against the model file's size. The process's CPU seconds beside each wall
time say how much of it was waiting on a busy machine.

    python scripts/startup_and_memory.py smollm2-135m-instruct [qwen2.5-coder-1.5b-instruct ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def timed_run(
    model: str, cache_dir: str, tile_dir: str, n: int = 1, ctx: int = 512
) -> tuple[float, float, float]:
    """(seconds, CPU seconds, peak RSS in MB) of one `fastrun run` process generating n
    tokens; tile_dir "off": no tile cache."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, FASTRUN_TILE_CACHE=tile_dir)
    code = (
        "import resource, subprocess, sys, time;"
        "t = time.perf_counter();"
        f"subprocess.run([sys.executable, '-m', 'fastrun.runner.cli', 'run', {model!r}, 'Hello',"
        f" '-n', '{n}', '-c', '{ctx}', '--temp', '0'], check=True, capture_output=True);"
        "dt = time.perf_counter() - t;"
        "r = resource.getrusage(resource.RUSAGE_CHILDREN);"
        "print(dt, r.ru_utime + r.ru_stime, r.ru_maxrss / 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    seconds, cpu, rss = out.stdout.split()
    return float(seconds), float(cpu), float(rss)


def main() -> None:
    from fastrun.runner.registry import resolve_model

    print(
        "| model | file MB | cold first token s (CPU s) | warm (CPU s) | warm, no tile cache "
        "(CPU s) | peak RSS MB | peak RSS MB, no tile cache |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in sys.argv[1:] or ["smollm2-135m-instruct"]:
        size = os.path.getsize(resolve_model(model)) / 1e6
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as tiles:
            cold = timed_run(model, cache, tiles)
            warm = min(timed_run(model, cache, tiles) for _ in range(3))
            untiled = min(timed_run(model, cache, "off") for _ in range(3))
            rss = timed_run(model, cache, tiles, n=64)[2]
            rss_untiled = timed_run(model, cache, "off", n=64)[2]
        cells = [f"{s:.2f} ({c:.2f})" for s, c, _ in (cold, warm, untiled)]
        print(
            f"| {model} | {size:.0f} | {' | '.join(cells)} | {rss:.0f} | {rss_untiled:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
