#!/usr/bin/env python3
"""llama.cpp's own numbers for one GGUF file, from the machine's own llama.cpp build: the
teacher texts' log-probabilities (as ../shared/golden holds them, but the whole vocabulary)
and, for the first --tokens of one text, every named float32 tensor of its graph (through
the scheduler's eval callback: attn_norm-0, Qcur-0, kq_soft_max-0, l_out-0, ...).

It runs under the ctypes bindings of the llama-cpp-python sdist that llama.cpp was built
from, not under fastrun's environment (they need typing_extensions, diskcache and jinja2):

    SDIST=/work/llamacpp/llama_cpp_python-0.3.36
    LLAMA_CPP_LIB_PATH=$SDIST/build/bin PYTHONPATH=$SDIST python scripts/llamacpp_dump.py \\
        MODEL.gguf GOLDEN.npz --out llamacpp.npz --tensors apache --tokens 16

scripts/compare_llamacpp.py then compares it with the golden data and with fastrun.
Settings are llama-cpp-python's defaults, as the golden data used: flash attention off.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np


class GGMLTensor(ctypes.Structure):
    """The head of ggml.h's struct ggml_tensor, up to its name (GGML_MAX_DIMS 4, 64 bytes of
    op params, GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


def contiguous_f32(t: GGMLTensor):
    """A copy of a computed, contiguous float32 tensor, shaped [ne3, ne2, ne1, ne0]; else None."""
    ne, nb = list(t.ne), list(t.nb)
    if t.type != 0 or not t.data or nb[0] != 4:
        return None
    if nb[1] != 4 * ne[0] or nb[2] != nb[1] * ne[1] or nb[3] != nb[2] * ne[2]:
        return None
    n = ne[0] * ne[1] * ne[2] * ne[3]
    flat = np.ctypeslib.as_array((ctypes.c_float * n).from_address(t.data)).copy()
    return flat.reshape(ne[3], ne[2], ne[1], ne[0]).squeeze()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("golden", help="the model's ../shared/golden .npz (its teacher tokens)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tensors", default="apache", help="teacher text whose tensors to dump")
    ap.add_argument("--tokens", type=int, default=16, help="its first tokens, one batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--products-fixture", metavar="NPZ",
        help="also write PRODUCTS' inputs and outputs (first 4 tokens) for the tests",
    )  # fmt: skip
    ap.add_argument("--products", default="gemma3", help="the PRODUCTS of this model: its prefix")
    args = ap.parse_args()
    import llama_cpp as L  # the sdist's bindings, over LLAMA_CPP_LIB_PATH's libllama

    golden = np.load(args.golden)
    tensors: dict[str, np.ndarray] = {}

    @L.ggml_backend_sched_eval_callback
    def on_tensor(address, ask, _user):
        if ask:
            return True  # yes, show every tensor once it is computed
        t = GGMLTensor.from_address(address)
        value = contiguous_f32(t)
        if value is not None:
            name, k = t.name.decode(), 1
            key = name
            while key in tensors:  # a name reused within a layer (Qcur-0 before and after RoPE)
                k += 1
                key = f"{name}#{k}"
            tensors[key] = value
        return True

    L.llama_backend_init()
    model = L.llama_model_load_from_file(args.model.encode(), L.llama_model_default_params())
    result = {}

    def decode(tokens, callback):
        params = L.llama_context_default_params()
        params.n_ctx = params.n_batch = 512
        params.n_threads = params.n_threads_batch = args.threads
        params.flash_attn_type = 0  # disabled: llama-cpp-python's default
        if callback:
            params.cb_eval = on_tensor
        ctx = L.llama_init_from_model(model, params)
        batch = L.llama_batch_init(len(tokens), 0, 1)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 1
        batch.n_tokens = len(tokens)
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), (len(tokens) * vocab,))
        logits = logits.reshape(len(tokens), vocab).astype(np.float64)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        shifted = logits - logits.max(axis=1, keepdims=True)
        return (shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))).astype(np.float32)

    for key in golden.files:
        if key.startswith("teacher.") and key.endswith(".tokens"):
            name = key.split(".")[1]
            result[f"teacher.{name}.logprobs"] = decode(golden[key].tolist(), False)
            print(f"teacher {name}: {len(golden[key])} tokens", flush=True)
    first = golden[f"teacher.{args.tensors}.tokens"][: args.tokens].tolist()
    result["tensors.logprobs"] = decode(first, True)
    result.update({f"tensor.{k}": v for k, v in tensors.items()})
    np.savez(args.out, tensors_text=args.tensors, tensors_tokens=args.tokens, **result)
    print(f"{len(tensors)} tensors of {args.tensors}'s first {args.tokens} tokens -> {args.out}")
    if args.products_fixture:
        fixture = {}
        chosen = {k: v for k, v in PRODUCTS.items() if k.startswith(args.products + ".")}
        for key, (source, layer, weight, out) in chosen.items():
            name = key.split(".", 1)[1]
            fixture[f"{name}.x"] = tensors[source.format(layer)][:FIXTURE_TOKENS]
            fixture[f"{name}.y"] = tensors[out.format(layer)][:FIXTURE_TOKENS]
            fixture[f"{name}.weight"] = f"blk.{layer}.{weight}.weight" if weight else ""
        np.savez_compressed(args.products_fixture, **fixture)
        print(f"{len(chosen)} products' inputs and outputs -> {args.products_fixture}")


# The tests' products (tests/test_llamacpp_numerics.py), by model: a product of each weight
# format the model has and its RoPE: the input tensor, layer, weight (none: RoPE) and output
# tensor (names with the layer's place). The tokens were one batch of 16 (llama.cpp's
# prefill kernels: tinyBLAS, the repacked Q4_K, the tiled Q6_K); each token's result is its
# own, so 4 are kept.
FIXTURE_TOKENS = 4
PRODUCTS = {
    "gemma3.q5_0": ("attn_norm-{}", 0, "attn_q", "Qcur-{}"),
    "gemma3.q8_0": ("attn_norm-{}", 0, "attn_v", "Vcur-{}"),
    "gemma3.q6_k": ("ffn_geglu-{}", 0, "ffn_down", "ffn_out-{}"),
    "gemma3.q4_k": ("ffn_geglu-{}", 2, "ffn_down", "ffn_out-{}"),
    "gemma3.rope_local": ("Qcur_normed-{}", 1, "", "Qcur-{}#3"),
    "gemma3.rope_global": ("Qcur_normed-{}", 5, "", "Qcur-{}#3"),
    "smollm2.q4_1": ("attn_norm-{}", 0, "attn_q", "Qcur-{}"),
    "smollm2.rope_pairs": ("Qcur-{}#2", 0, "", "Qcur-{}#3"),
}


if __name__ == "__main__":
    main()
