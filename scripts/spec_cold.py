"""Cold one-shot runs of `fastrun run`, plain decoding against prompt lookup: a fresh process
each, as a script or a user runs it, so every CUDA graph a reply needs is captured inside it.
Prints each run's decode seconds (from its first token to its last), acceptance, and the
process's wall time (start-up and loading, which lookup's graph captures lengthen, included).

    python scripts/spec_cold.py --model smollm2-135m-instruct --backend cuda --repeat 3

Run once beforehand so that compiled kernels are in CuPy's disk cache (the first run of a
machine compiles them all).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from spec_bench import PROMPTS  # noqa: E402

FASTRUN = "import sys; from fastrun.runner.entry import main; sys.exit(main())"
FIELDS = ("decode_seconds", "decode_tokens_per_second", "prefill_seconds", "acceptance_rate")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--prompts", default="type-hints,fix-bug,rename")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-n", "--tokens", type=int, default=512)
    args = ap.parse_args()
    for rep in range(args.repeat):
        for p in args.prompts.split(","):
            for mode in ("plain", "lookup"):
                cmd = [sys.executable, "-c", FASTRUN, "run", args.model, PROMPTS[p], "--chat",
                       "--json", "--temp", "0", "-n", str(args.tokens), "--backend",
                       args.backend] + (["--lookup"] if mode == "lookup" else [])  # fmt: skip
                started = time.perf_counter()
                out = subprocess.run(cmd, capture_output=True, text=True)
                wall = time.perf_counter() - started  # the process's: start-up, load, run
                if out.returncode:
                    sys.exit(out.stderr[-2000:])
                timings = json.loads(out.stdout)["timings"]
                row = {k: timings.get(k) for k in FIELDS} | {"wall_seconds": round(wall, 3)}
                print(rep, p, mode, json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
