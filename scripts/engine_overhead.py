#!/usr/bin/env python3
"""What the engine adds to one sequence's decode: greedy tokens through `Model.generate` (the
engine's thread, its scheduler, sampler and the caller's stream) against the model's own
loop on the same thread (`Transformer.forward`, the token picked on the backend), alternating,
median of --rounds.

    python scripts/engine_overhead.py smollm2-135m-instruct -n 128 --rounds 5 -t 2
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=128, help="tokens generated per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()

    import fastrun
    from fastrun.runner.api import sampling_params
    from fastrun.runner.sampling import Sampler

    m = fastrun.load(args.model, backend=args.backend, n_ctx=args.n + 64, parallel=1,
                     threads=args.threads)  # fmt: skip
    tf = m.transformer
    prompt = m.tokenize("Once upon a time, in a quiet village by the sea,")
    # greedy to the last token (end of text ignored): the engine asks the backend for the best
    # 1 + (end-of-generation ids) candidates, so the model's loop below takes as many
    settings = dict(temperature=0, ignore_eos=True)
    eog = m.tokenizer.eog_ids
    k = Sampler(sampling_params(**settings), eog).candidates

    def pick(out) -> int:
        return next(int(t) for t in out[0][-1] if int(t) not in eog)

    def direct() -> float:  # seconds per token, the model's own loop
        cache = tf.new_cache(args.n + 64)
        token = pick(tf.forward(prompt, cache, top_k=k))
        t0 = time.perf_counter()
        for _ in range(args.n):
            token = pick(tf.forward([token], cache, top_k=k))
        return (time.perf_counter() - t0) / args.n

    def engine() -> float:  # seconds per token after the first, through the engine
        done = m.complete(prompt, max_tokens=args.n + 1, **settings)
        return done.decode_seconds / (len(done.tokens) - 1)

    m.engine.call(direct)  # warm-up: compiled kernels, page faults
    engine()
    ours, theirs = [], []
    for _ in range(args.rounds):
        theirs.append(m.engine.call(direct))
        ours.append(engine())
    a, b = statistics.median(ours), statistics.median(theirs)
    print(
        f"{args.model}, {args.backend}: the model's own loop {b * 1e3:.3f} ms a token "
        f"({1 / b:.1f} tok/s), through the engine {a * 1e3:.3f} ms ({1 / a:.1f} tok/s): "
        f"the engine adds {(a - b) * 1e3:+.3f} ms a token (median of {args.rounds} rounds)"
    )
    m.close()


if __name__ == "__main__":
    main()
