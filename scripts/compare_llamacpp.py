#!/usr/bin/env python3
"""fastrun against llama.cpp's own numbers (from scripts/llamacpp_dump.py) and the golden data.

    python scripts/compare_llamacpp.py MODEL.gguf GOLDEN.npz llamacpp.npz

Teacher texts: top-1 agreement and mean KL (positions from 1, the golden README's measure)
of this machine's llama.cpp build against the golden data (made by another build: the noise
between two llama.cpp builds) and of fastrun against both. Then, layer by layer over the
dumped tokens, fastrun's attention output and block output (the Python block path on the CPU
backend) against llama.cpp's kqv_out-i and l_out-i: each token's largest difference relative
to that token's largest value. The first layer and token where it leaves ~1e-7 is where to
look for a rounding step fastrun does differently.
"""

from __future__ import annotations

import argparse

import numpy as np


def agreement(logprobs, top_ids, top_logprobs):
    """(top-1 agreement, mean KL over the listed tokens), positions 1..n-1."""
    top1 = (logprobs.argmax(axis=1) == top_ids[:, 0])[1:].mean()
    ours = np.take_along_axis(logprobs, top_ids, axis=1)
    kl = (np.exp(top_logprobs) * (top_logprobs - ours)).sum(axis=1)[1:].mean()
    return top1, kl


def top40(logprobs, k=40):
    ids = np.argsort(-logprobs, axis=1)[:, :k]
    return ids, np.take_along_axis(logprobs, ids, axis=1)


def relative_rows(ours, theirs) -> np.ndarray:
    ours = np.asarray(ours, np.float64).reshape(len(theirs), -1)
    theirs = np.asarray(theirs, np.float64).reshape(len(theirs), -1)
    return np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("golden")
    ap.add_argument("llamacpp", help="scripts/llamacpp_dump.py's output")
    args = ap.parse_args()
    from fastrun.runner.api import Model

    golden, theirs = np.load(args.golden), np.load(args.llamacpp)
    model = Model(args.model, n_ctx=512)
    print("teacher text   | llama.cpp here vs golden | fastrun vs golden | fastrun vs here")
    for key in theirs.files:
        if not key.startswith("teacher."):
            continue
        name = key.split(".")[1]
        ref = golden[f"teacher.{name}.top_ids"], golden[f"teacher.{name}.top_logprobs"]
        here = theirs[key]
        ours = model.logprobs(golden[f"teacher.{name}.tokens"])
        cells = [agreement(here, *ref), agreement(ours, *ref), agreement(ours, *top40(here))]
        print(f"{name:14s} | " + " | ".join(f"{t:6.2%}  KL {kl:.4f}" for t, kl in cells))

    text, n = str(theirs["tensors_text"]), int(theirs["tensors_tokens"])
    transformer = model.transformer
    transformer._stack = None  # the Python block path: each block's output is visible
    attention_out, block_out = [], []
    attention_block, ffn_block = transformer._attention_block, transformer._ffn_block

    def record_attention(x, layer, *rest):
        backend = transformer.backend
        real = backend.attention

        def attention(*a, **k):
            out = real(*a, **k)
            attention_out.append(np.array(out, np.float32))
            return out

        backend.attention = attention
        try:
            return attention_block(x, layer, *rest)
        finally:
            backend.attention = real

    def record_block(x, layer, *rest):
        out = ffn_block(x, layer, *rest)
        block_out.append(np.array(out, np.float32))
        return out

    transformer._attention_block, transformer._ffn_block = record_attention, record_block
    cache = transformer.new_cache(512)
    ours = transformer.forward(golden[f"teacher.{text}.tokens"][:n], cache, all_logits=True)
    print(f"\n{text}'s first {n} tokens: per token, max |fastrun - llama.cpp| / max |llama.cpp|")
    for i, (att, out) in enumerate(zip(attention_out, block_out, strict=True)):
        for label, mine, name in (("attn", att, f"kqv_out-{i}"), ("out ", out, f"l_out-{i}")):
            if f"tensor.{name}" in theirs.files:
                rows = relative_rows(mine, theirs[f"tensor.{name}"])
                print(f"layer {i:2d} {label} " + " ".join(f"{r:.0e}" for r in rows))
    logits = np.asarray(ours, np.float64)
    logprobs = logits - logits.max(axis=1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(axis=1, keepdims=True))
    gap = np.abs(logprobs - theirs["tensors.logprobs"]).max(axis=1)
    print("log-probs, max |diff| per token: " + " ".join(f"{g:.2f}" for g in gap))


if __name__ == "__main__":
    main()
