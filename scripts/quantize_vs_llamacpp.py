"""fastrun quantize / perplexity against llama.cpp's llama-quantize / llama-perplexity.

Not part of CI: it needs a native llama.cpp build (tools in --llama-bin) and SmolLM2 from the
registry. Steps, each printed as it finishes and gathered in one JSON report:

1. an F16 GGUF of SmolLM2, made by `fastrun quantize --type F16 --allow-requantize` from Q4_1;
2. Q8_0, Q4_0, Q4_1, Q5_0 and Q4_K_M by both tools from that F16 file, timed run against run
   (alternating, the same thread count), compared byte for byte: whole file, each tensor's type,
   and per tensor type the share of identical blocks;
3. every output loaded by both programs: perplexity on the first chunk;
4. perplexity of the F16 file and both Q4_K_M files on the license texts, -c 512, with tokens
   per second for both programs, run against run (alternating, --repeats times, medians): over
   the whole process (load included) and over the evaluation alone (fastrun prints its own;
   llama-perplexity's is the time between its log lines "tokenization took" and "Final
   estimate", which it stamps).

    python scripts/quantize_vs_llamacpp.py --llama-bin .../llama.cpp/build/bin --chunks 8
    python scripts/quantize_vs_llamacpp.py --llama-bin ... --only-perplexity --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from fastrun.formats import GGUFFile
from fastrun.runner.registry import resolve_model

LICENSES = ["GPL-3", "GPL-2", "LGPL-2.1"]
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K_M"]  # timed, loaded and compared
MORE_TYPES = ["Q5_1", "Q4_K_S", "Q5_K_S", "Q5_K_M", "Q6_K", "BF16", "F32"]  # compared only


def run(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return seconds, r.stdout + r.stderr


def fastrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "fastrun.runner.cli", *args]


def compare_files(ours: Path, theirs: Path) -> dict:
    """Whole-file identity, tensors whose types differ, identical blocks per tensor type."""
    same_blocks: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    type_mismatch = []
    with GGUFFile(ours) as a, GGUFFile(theirs) as b:
        for name, ta in a.tensors.items():
            tb = b.tensor(name)
            if ta.format.name != tb.format.name:
                type_mismatch.append(f"{name}: {ta.format.name} vs {tb.format.name}")
                continue
            fmt = ta.format
            raw_a = a.tensor_bytes(name).reshape(-1, fmt.block_bytes)
            raw_b = b.tensor_bytes(name).reshape(-1, fmt.block_bytes)
            counts = same_blocks[fmt.name]
            counts[0] += int((raw_a == raw_b).all(axis=1).sum())
            counts[1] += raw_a.shape[0]
        meta_same = a.metadata.keys() == b.metadata.keys()
    return {
        "identical_file": ours.read_bytes() == theirs.read_bytes(),
        "same_metadata_keys": meta_same,
        "type_mismatches": type_mismatch,
        "identical_blocks": {
            t: f"{s}/{n} ({100 * s / n:.2f} %)" for t, (s, n) in same_blocks.items()
        },
    }


def parse_ppl(out: str) -> tuple[float, float]:
    """PPL and its error from either program's output."""
    m = re.search(r"PPL = ([\d.]+) \+/- ([\d.]+)", out)
    return float(m.group(1)), float(m.group(2))


def llama_eval_seconds(out: str) -> float:
    """llama-perplexity's evaluation time: from its tokenization's end to its final estimate,
    by the stamps (minutes.seconds.milliseconds.microseconds) of those log lines."""

    def stamp(line_text: str) -> float:
        m = re.search(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) .*" + re.escape(line_text), out, re.M)
        minutes, seconds, ms, us = (int(g) for g in m.groups())
        return 60 * minutes + seconds + ms / 1e3 + us / 1e6

    return stamp("Final estimate") - stamp("tokenization took")


def fastrun_eval_seconds(out: str) -> float:
    return float(re.search(r"\(([\d.]+) s for \d+ tokens\)", out).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantize_vs_llamacpp"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=None, help="perplexity chunks (default: all)")
    ap.add_argument("--skip-perplexity", action="store_true")
    ap.add_argument(
        "--only-perplexity", action="store_true", help="step 4 alone (Q4_K_M files made if absent)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="perplexity runs of each program")
    args = ap.parse_args()
    work, t = args.work, str(args.threads)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"threads": args.threads, "load_average": os.getloadavg()}

    f16 = work / "smollm2-f16.gguf"
    if not f16.exists():
        src = resolve_model("smollm2-135m-instruct")
        run(fastrun("quantize", str(src), str(f16), "--type", "F16", "--allow-requantize"))

    for qtype in [] if args.only_perplexity else TYPES + MORE_TYPES:
        ours, theirs = work / f"fastrun-{qtype}.gguf", work / f"llama-{qtype}.gguf"
        times = {"fastrun": [], "llama": []}
        for _ in range(2 if qtype in TYPES else 1):  # alternate: both see the same load
            llama = [str(args.llama_bin / "llama-quantize"), str(f16), str(theirs), qtype, t]
            times["llama"].append(run(llama)[0])
            ours_cmd = fastrun("quantize", str(f16), str(ours), "--type", qtype, "-t", t, "--force")
            times["fastrun"].append(run(ours_cmd)[0])
        best = {k: min(v) for k, v in times.items()}
        entry = compare_files(ours, theirs)
        entry.update(seconds=best, speed_ratio=round(best["llama"] / best["fastrun"], 3))
        report[qtype] = entry
        print(qtype, json.dumps(entry), flush=True)

    text = work / "licenses.txt"
    text.write_text("".join(Path("/usr/share/common-licenses", n).read_text() for n in LICENSES))

    def both_ppl(model: Path, chunks: int | None, repeats: int = 1) -> dict:
        """Both programs on the same chunks, alternating; tokens per second over each whole
        process (load included) and over the evaluation alone, medians of the runs."""
        extra = ["--chunks", str(chunks)] if chunks else []
        cmd = [str(args.llama_bin / "llama-perplexity"), "-m", str(model), "-f", str(text)]
        ours_cmd = fastrun("perplexity", str(model), str(text), "-c", "512", "-t", t, *extra)
        seconds = {"llama": [], "fastrun": [], "llama_eval": [], "fastrun_eval": []}
        for _ in range(repeats):
            llama_s, llama_out = run([*cmd, "-c", "512", "-t", t, *extra])
            ours_s, ours_out = run(ours_cmd)
            seconds["llama"].append(llama_s)
            seconds["llama_eval"].append(llama_eval_seconds(llama_out))
            seconds["fastrun"].append(ours_s)
            seconds["fastrun_eval"].append(fastrun_eval_seconds(ours_out))
        med = {k: statistics.median(v) for k, v in seconds.items()}
        llama, ours = parse_ppl(llama_out), parse_ppl(ours_out)
        n_tokens = 512 * int(re.search(r"(\d+) chunks of 512", ours_out).group(1))

        def side(ppl, name):
            return {
                "ppl": ppl[0],
                "err": ppl[1],
                "tokens_per_s": round(n_tokens / med[name], 1),
                "eval_tokens_per_s": round(n_tokens / med[f"{name}_eval"], 1),
                "seconds": [round(x, 2) for x in seconds[name]],
                "eval_seconds": [round(x, 2) for x in seconds[f"{name}_eval"]],
            }

        return {
            "tokens": n_tokens,
            "llama": side(llama, "llama"),
            "fastrun": side(ours, "fastrun"),
            "ppl_difference_pct": round(100 * (ours[0] / llama[0] - 1), 4),
            "speed_ratio": round(med["llama"] / med["fastrun"], 3),
            "eval_speed_ratio": round(med["llama_eval"] / med["fastrun_eval"], 3),
        }

    if args.only_perplexity:  # the two Q4_K_M files, made once
        for maker, cmd in [
            ("fastrun", fastrun("quantize", str(f16), "", "--type", "Q4_K_M", "-t", t)),
            ("llama", [str(args.llama_bin / "llama-quantize"), str(f16), "", "Q4_K_M", t]),
        ]:
            out = work / f"{maker}-Q4_K_M.gguf"
            if not out.exists():
                run([str(out) if part == "" else part for part in cmd])
    else:  # every output loads and runs in both programs: one chunk each
        report["loads"] = {q: both_ppl(work / f"fastrun-{q}.gguf", 1) for q in TYPES}
        print("loads", json.dumps(report["loads"]), flush=True)
    if not args.skip_perplexity:
        report["perplexity"] = {
            name: both_ppl(path, args.chunks, args.repeats)
            for name, path in [
                ("F16", f16),
                ("Q4_K_M fastrun", work / "fastrun-Q4_K_M.gguf"),
                ("Q4_K_M llama", work / "llama-Q4_K_M.gguf"),
            ]
        }
        print("perplexity", json.dumps(report["perplexity"]), flush=True)
    report["load_average_end"] = os.getloadavg()
    (work / "report.json").write_text(json.dumps(report, indent=1))
    print(f"report: {work / 'report.json'}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
