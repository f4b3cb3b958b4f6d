#!/usr/bin/env python3
"""How far a context shift moves a real model's next-token distribution: the cells after a
shift (the first --keep tokens kept, the next --discard dropped, the rest moved down with their
keys re-rotated) against a fresh prefill of the kept tokens at their new positions.

    python scripts/context_shift_kl.py smollm2-135m-instruct --tokens 400 --discard 150

Only the keys' positions are exact after a shift: in every layer past the first, the kept
tokens' keys and values were computed while the dropped tokens were still there, so a deep
model's distribution moves by what those tokens contributed (llama.cpp's shift is the same).
The mean KL(fresh || shifted) over --probes next tokens is printed, with top-1 agreement,
and how far layer 0's re-rotated keys are from fresh ones (there the shift must be exact).
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=400, help="prompt tokens before the shift")
    ap.add_argument("--keep", type=int, default=4)
    ap.add_argument("--discard", type=int, default=150)
    ap.add_argument("--probes", type=int, default=16, help="next tokens compared")
    args = ap.parse_args()

    import fastrun
    from fastrun.runner.generate import log_softmax

    text = open("/usr/share/common-licenses/GPL-3").read()
    m = fastrun.load(args.model, backend="cpu", n_ctx=args.tokens + args.probes + 8, parallel=1)
    ids = m.tokenize(text)[: args.tokens + args.probes]
    prompt, probes = ids[: args.tokens], ids[args.tokens :]
    tf = m.transformer
    keep, discard = args.keep, args.discard

    def measure():
        kls, agree = [], 0
        n_ctx = args.tokens + args.probes + 8
        shifted = tf.new_cache(n_ctx)
        tf.forward(prompt, shifted)
        shifted.shift(keep, discard, tf.config.rope)
        kept = prompt[:keep] + prompt[keep + discard :]
        fresh = tf.new_cache(n_ctx)
        tf.forward(kept, fresh)
        rows = slice(0, len(kept))  # layer 0's cells depend on their own token alone
        k0 = [np.asarray(tf.backend.to_host(c.k[0, rows]), np.float32) for c in (shifted, fresh)]
        layer0 = float(np.abs(k0[0] - k0[1]).max() / np.abs(k0[1]).max())
        for token in probes:
            a = log_softmax(tf.forward([token], shifted)[0])
            b = log_softmax(tf.forward([token], fresh)[0])
            kls.append(float(np.sum(np.exp(b) * (b - a))))
            agree += int(np.argmax(a) == np.argmax(b))
        return float(np.mean(kls)), agree, layer0

    kl, agree, layer0 = m.engine.call(measure)
    print(
        f"{args.tokens} tokens, keep {keep}, drop {discard}: mean KL(fresh || shifted) = "
        f"{kl:.4f} over {len(probes)} next tokens, top-1 agreement {agree}/{len(probes)}; "
        f"layer 0's shifted keys against fresh ones: max |diff| / max |key| = {layer0:.1e}"
    )
    m.close()


if __name__ == "__main__":
    main()
