#!/usr/bin/env python3
"""A long prompt submitted while another sequence streams: how long does the streaming one
wait between two tokens? The engine prefills in chunks of --batch-size tokens beside the decode
steps, so the longest gap should be about one chunk's time, not the whole prompt's.

    python scripts/engine_latency.py smollm2-135m-instruct --prompt 3000 --batch-size 512
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="registry name or GGUF path")
    ap.add_argument("--prompt", type=int, default=3000, help="tokens of the long prompt")
    ap.add_argument("-b", "--batch-size", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()

    import fastrun

    m = fastrun.load(
        args.model, backend=args.backend, n_ctx=args.prompt + 64, parallel=2,
        batch_size=args.batch_size, threads=args.threads,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = m.config.n_vocab
    greedy = dict(temperature=0, ignore_eos=True)
    m.complete(rng.integers(0, vocab, 600).tolist(), max_tokens=4, **greedy)  # warm-up

    streaming = m.generate(rng.integers(0, vocab, 16).tolist(), max_tokens=100000, **greedy)
    arrivals = []
    for _ in range(20):  # decoding alone first
        next(streaming)
        arrivals.append(time.perf_counter())
    alone = float(np.median(np.diff(arrivals)))

    long_done = {}

    def run_long():
        t0 = time.perf_counter()
        stream = m.generate(rng.integers(0, vocab, args.prompt).tolist(), max_tokens=1, **greedy)
        for _ in stream:
            pass
        long_done["at"] = time.perf_counter()
        long_done["seconds"] = long_done["at"] - t0

    submitted = time.perf_counter()
    worker = threading.Thread(target=run_long)
    worker.start()
    during = [submitted]
    while "at" not in long_done:
        next(streaming)
        during.append(time.perf_counter())
    worker.join()
    streaming.close()
    gaps = np.diff(during)
    chunks = -(-args.prompt // args.batch_size)
    per_chunk = long_done["seconds"] / chunks
    print(f"decode alone: {alone * 1e3:.1f} ms a token")
    print(
        f"{args.prompt}-token prompt prefilled in {long_done['seconds']:.2f} s "
        f"({chunks} chunks of {args.batch_size}: {per_chunk * 1e3:.0f} ms each) while the other "
        f"sequence streamed {len(gaps)} tokens"
    )
    print(
        f"streaming sequence's gaps meanwhile: longest {gaps.max() * 1e3:.0f} ms "
        f"({gaps.max() / per_chunk:.2f} chunk times), median {np.median(gaps) * 1e3:.0f} ms"
    )
    m.close()


if __name__ == "__main__":
    main()
