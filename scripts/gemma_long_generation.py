#!/usr/bin/env python3
"""A real Gemma 3 generation far past its 512-position window, with the sliding-window layers
on their rings (runner/kv_cache.py): `fastrun run` writes 2,000 tokens of a story, this prints
the text for a human to judge and checks simple signals (no token repeated on and on, the
story's topic words still there in its last quarter, variety of tokens late), and writes the
KV cache's bytes with rings and with full rows for a context of --ctx tokens.

    python scripts/gemma_long_generation.py [--model gemma3-270m] [--tokens 2000] [--ctx 8192]

Exit status 1 where a signal fails. The model is a GGUF path or a registry name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

PROMPT = (
    "Write a long story about an old lighthouse keeper on a lonely island: the storms, the "
    "ships he guides past the rocks, the lamp he tends every night, and the letters he writes "
    "to his daughter on the mainland. Once upon a time,"
)
TOPIC = ("lighthouse", "keeper", "sea", "lamp", "light", "island", "ship", "storm", "daughter")
FULL_STORAGE = (
    "import sys; from fastrun.runner import kv_cache; kv_cache.ring_rows = lambda *a: 0; "
    "from fastrun.runner.cli import main; sys.exit(main(sys.argv[1:]))"
)
LONGEST_RUN = 12  # the same token more times in a row than this: degenerate
MIN_DISTINCT = 0.15  # distinct tokens in the last quarter, at least this share of them


def cache_bytes(model: str, n_ctx: int, batch: int) -> dict:
    """The KV cache's bytes on the CPU (float32) and CUDA (fp16) for one sequence of n_ctx,
    with rings and with every layer's full rows."""
    from fastrun.formats.gguf import GGUFFile
    from fastrun.runner import kv_cache
    from fastrun.runner.models import model_class
    from fastrun.runner.registry import resolve_model

    f = GGUFFile(str(resolve_model(model)))
    config = model_class(f.architecture).config_class.from_gguf(f)
    windows = [at.window for at in config.block().layers]
    row = 2 * config.n_head_kv * config.head_dim  # keys and values of a row, in values
    rings = kv_cache.storage_rows(windows, 1, n_ctx, batch)
    rows = sum(layers * n for layers, n in rings.values())
    full_rows = len(windows) * (n_ctx + 1)
    return {
        "n_ctx": n_ctx,
        "ring_rows": kv_cache.ring_rows(windows, n_ctx, batch),
        "layers": {"full": rings["full"][0], "ring": rings["ring"][0]},
        "cpu_bytes": {"rings": 4 * row * rows, "full": 4 * row * full_rows},
        "cuda_bytes": {"rings": 2 * row * rows, "full": 2 * row * full_rows},
    }


def signals(text: str, tokens: list[int]) -> dict:
    """Simple checks a degenerate or drifting generation fails."""
    longest, run = 1, 1
    for a, b in zip(tokens, tokens[1:], strict=False):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    last = tokens[3 * len(tokens) // 4 :]
    late = text[3 * len(text) // 4 :].lower()
    return {
        "longest_repeat": longest,
        "distinct_late": len(set(last)) / max(1, len(last)),
        "topic_words_late": sorted(w for w in TOPIC if w in late),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument(
        "--full-storage",
        action="store_true",
        help="every layer on full rows (no rings), for the comparison: the same seed must "
        "give the same text",
    )
    args = ap.parse_args()

    print(json.dumps(cache_bytes(args.model, args.ctx, 512), indent=1))
    launcher = ["-m", "fastrun.runner.cli"]
    if args.full_storage:  # the CLI with ring_rows answering 0 (runner/kv_cache.py)
        launcher = ["-c", FULL_STORAGE]
    command = [
        sys.executable, *launcher, "run", args.model, PROMPT,
        "-n", str(args.tokens), "-c", str(args.ctx), "--ignore-eos", "--seed", str(args.seed),
        "--repeat-penalty", "1.1", "--presence-penalty", str(args.presence_penalty),
        "--backend", args.backend, "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    result = json.loads(done.stdout)
    print(result["text"])
    found = signals(result["text"], result["tokens"])
    found["tokens"] = len(result["tokens"])
    print(json.dumps(found))
    digest = hashlib.sha256(json.dumps(result["tokens"]).encode()).hexdigest()[:16]
    print(f"tokens sha256 {digest} ({'full storage' if args.full_storage else 'rings'})")
    ok = (
        found["tokens"] == args.tokens
        and found["longest_repeat"] <= LONGEST_RUN
        and found["distinct_late"] >= MIN_DISTINCT
        and len(found["topic_words_late"]) >= 2
    )
    print("OK" if ok else "FAILED: a signal of a degenerate or drifting generation")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
