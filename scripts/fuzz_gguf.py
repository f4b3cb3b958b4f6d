"""Fuzz the CLI with damaged GGUF files: thousands of mutants through `fastrun info` and
`fastrun run -n 1`, each a subprocess under an address-space limit (ulimit -v), counting what
must never happen: a traceback, a crash (a signal or an unexpected exit code), a hang, an error
of more than one line.

    python scripts/fuzz_gguf.py --count 3000 --jobs 2 [--real smollm2-135m-instruct]

The mutants come from tests/mutants.py (seeded: the same seed gives the same files); a failing
mutant is kept under --keep for a look.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import write_tiny_model  # noqa: E402
from mutants import mutants  # noqa: E402


def _limit_memory(limit_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return apply


def classify(proc: subprocess.CompletedProcess | None) -> str:
    """ok, refused (one error line, exit 2), or what went wrong."""
    if proc is None:
        return "hang"
    if "Traceback (most recent call last)" in proc.stderr:
        return "traceback"
    if proc.returncode < 0 or proc.returncode not in (0, 2):
        return f"crash(rc={proc.returncode})"
    if proc.returncode == 0:
        return "ok"
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in errors if not line.startswith("fastrun: warning:")]
    if len(errors) == 1 and errors[0].startswith("fastrun: error: "):
        return "refused"
    return "untidy-error"


def run_cli(
    args: list[str], timeout: float, memory: int, env: dict
) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            [sys.executable, "-m", "fastrun.runner.cli", *args],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            preexec_fn=_limit_memory(memory),
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2000, help="mutants in all")
    ap.add_argument("--jobs", type=int, default=2, help="subprocesses at once")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--memory-gb", type=float, default=8.0, help="ulimit -v of each run")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a hang")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long")
    ap.add_argument("--real", default=None, help="also mutate this registry model (10%%)")
    ap.add_argument("--run-share", type=float, default=0.2,
                    help="share of files `info` refuses that `run` gets too")  # fmt: skip
    ap.add_argument("--boundscheck", action="store_true",
                    help="kernels with bounds checks (a read past an array: a traceback); "
                    "compiled once into a cache folder of their own")  # fmt: skip
    ap.add_argument("--keep", type=Path, default=Path("fuzz-failures"))
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fastrun-fuzz-"))
    bases = [
        write_tiny_model(work / "llama.gguf", n_embd=64, n_ff=128).read_bytes(),
        write_tiny_model(work / "qwen2.gguf", arch="qwen2", n_embd=64, n_ff=128).read_bytes(),
    ]
    streams = [mutants(b, args.seed + i) for i, b in enumerate(bases)]
    if args.real:
        from fastrun.runner.registry import resolve_model

        real = mutants(resolve_model(args.real).read_bytes(), args.seed + 99)
    memory = int(args.memory_gb * 2**30)
    env = dict(os.environ, FASTRUN_TEMPLATE_SECONDS="1")
    if args.boundscheck:
        cache = Path(tempfile.gettempdir()) / "fastrun-fuzz-boundscheck-cache"
        env.update(NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(cache))
    deadline = time.monotonic() + args.minutes * 60 if args.minutes else None
    lock = threading.Lock()
    counts: dict[str, Counter] = {"info": Counter(), "run": Counter()}
    failures: list[dict] = []
    started = time.monotonic()

    def one(n: int) -> None:
        if deadline and time.monotonic() > deadline:
            return
        with lock:  # the generators are not thread-safe
            source = real if args.real and n % 10 == 9 else streams[n % len(streams)]
            what, data = next(source)
        path = work / f"m{n}.gguf"
        path.write_bytes(data)
        try:
            info = classify(run_cli(["info", str(path), "--json"], args.timeout, memory, env))
            results = {"info": info}
            if info == "ok" or (n * 0.6180339887) % 1 < args.run_share:
                cmd = ["run", str(path), "hi", "-n", "1", "--backend", "cpu", "-c", "64"]
                cmd += ["--chat"] if n % 2 or "template" in what else []  # the template too
                results["run"] = classify(run_cli(cmd, args.timeout, memory, env))
            with lock:
                for command, outcome in results.items():
                    counts[command][outcome] += 1
                    if outcome not in ("ok", "refused"):
                        args.keep.mkdir(exist_ok=True)
                        kept = args.keep / f"{n}-{command}.gguf"
                        kept.write_bytes(data)
                        failures.append({"n": n, "mutation": what, command: outcome,
                                         "file": str(kept)})  # fmt: skip
                done = sum(counts["info"].values())
                if done % 100 == 0:
                    rate = done / (time.monotonic() - started)
                    print(f"{done} files ({rate:.2f}/s): info {dict(counts['info'])}, "
                          f"run {dict(counts['run'])}", flush=True)  # fmt: skip
        finally:
            path.unlink(missing_ok=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, range(args.count)))
    shutil.rmtree(work, ignore_errors=True)

    bad = {c: sum(v for k, v in counts[c].items() if k not in ("ok", "refused")) for c in counts}
    report = {
        "files": sum(counts["info"].values()),
        "seconds": round(time.monotonic() - started, 1),
        "memory_limit_gb": args.memory_gb,
        "boundscheck": args.boundscheck,
        "info": dict(counts["info"]),
        "run": dict(counts["run"]),
        "failures": failures[:50],
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
