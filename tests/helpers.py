"""Test helpers: golden reference data, real models from models.toml, tiny synthetic GGUF files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fastrun.quant.formats import block_format
from fastrun.quant.reference import quantize_ref

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("FASTRUN_GOLDEN", REPO.parent / "shared" / "golden"))

# Registry name -> golden file stem.
GOLDEN_MODELS = {
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct.Q4_1",
    "gemma3-270m": "gemma-3-270m-Q4_K_M",
    "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b-instruct-Q4_K_M",
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-1.5b-instruct-Q4_K_M",
}


def real_model(name: str) -> Path:
    """Path of a registry model, pulled on first use; skips when it cannot be had."""
    from fastrun.formats.errors import FastrunError
    from fastrun.runner.registry import resolve_model

    try:
        return resolve_model(name)
    except FastrunError as e:
        pytest.skip(f"{name} not available: {e}")


def golden(name: str):
    path = GOLDEN / f"{GOLDEN_MODELS[name]}.npz"
    if not path.exists():
        pytest.skip(f"no golden data at {path}")
    return np.load(path)


# -- synthetic models --------------------------------------------------------------------------


# typical |sub-block scale * quant| of random K-quant fields, to scale them to a given std
_K_SPAN = {"Q4_K": 256.0, "Q5_K": 512.0, "Q6_K": 1024.0}


def random_blocks(
    qtype: str,
    n_rows: int,
    n_cols: int,
    rng: np.random.Generator,
    fast: bool = False,
    std: float = 0.05,
) -> np.ndarray:
    """Raw bytes [n_rows, row_bytes] of a random weight matrix in any supported format.

    fast: random quantized fields with sane scales for every block format (no float matrix
    quantized), for model-sized benchmarks. std: of the float weights quantized otherwise."""
    fmt = block_format(qtype)
    if fast and qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):  # K-quants: always fast
        nb = n_rows * n_cols // fmt.block_size
        raw = rng.integers(0, 256, (nb, fmt.block_bytes), dtype=np.uint8)
        for at in (0, 2) if qtype in ("Q4_1", "Q5_1") else (0,):  # d (and m)
            d = (rng.random(nb) * 0.004 + 0.001).astype(np.float16)
            raw[:, at : at + 2] = d.view(np.uint8).reshape(nb, 2)
        return raw.reshape(n_rows, -1)
    if qtype in _K_SPAN:
        # K-quants: random integer fields; fp16 super-block scales that give weights of about std
        nb = n_rows * n_cols // fmt.block_size
        raw = rng.integers(0, 256, (nb, fmt.block_bytes), dtype=np.uint8)
        for at in (208,) if qtype == "Q6_K" else (0, 2):
            d = (rng.random(nb) + 0.5) * std / _K_SPAN[qtype]
            raw[:, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
        return raw.reshape(n_rows, -1)
    x = rng.standard_normal((n_rows, n_cols)).astype(np.float32) * std
    if qtype == "F32":
        return x.view(np.uint8).reshape(n_rows, -1)
    if qtype == "F16":
        return x.astype(np.float16).view(np.uint8).reshape(n_rows, -1)
    return quantize_ref(x, qtype).reshape(n_rows, -1)


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    qtype: str = "Q4_0",
    n_embd: int = 256,
    n_ff: int = 512,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_vocab: int = 300,
    n_ctx: int = 256,
    seed: int = 0,
    tied: bool = True,
    fast: bool = False,
    window: int = 8,
) -> Path:
    """Write a small llama/qwen2 GGUF with random weights and a byte-level BPE vocabulary;
    arch "gemma3": the Gemma 3 block (Q/K head norms, post-norms, GELU gating, five local
    layers of `window` positions to one global, each kind with its own RoPE base)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(0)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", window)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", 6)
        w.add_float32(f"{arch}.rope.freq_base_swa", 1000.0)
    # Vocabulary: 256 byte-level singletons, some merges' results, then control tokens.
    from fastrun.runner.tokenizer import _BYTE_TO_CHAR

    chars = [_BYTE_TO_CHAR[b] for b in range(256)]
    tokens = list(chars)
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    while len(tokens) < n_vocab - len(specials):
        tokens.append(f"<extra_{len(tokens)}>")
    tokens += specials
    types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)

    def add(name: str, rows: int, cols: int, qt: str = qtype, std: float = 0.05) -> None:
        raw = random_blocks(qt, rows, cols, rng, fast, std)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[qt])

    def add_f32(name: str, values: np.ndarray) -> None:
        w.add_tensor(name, values.astype(np.float32))

    head_dim = n_embd // n_head
    # Deep random stacks with q/k of std 0.05 attend near one-hot, and rounding noise then
    # flips which key wins: small q/k weights keep a deep synthetic model as stable as a
    # trained one (CPU against the NumPy reference: mean KL 0.26 at 0.05, 6e-4 at 0.002).
    qk_std = 0.002 if n_layer > 4 else 0.05
    add("token_embd.weight", n_vocab, n_embd, "Q8_0" if qtype != "F32" else "F32")
    for i in range(n_layer):
        add_f32(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(n_embd))
        add(f"blk.{i}.attn_q.weight", n_embd, n_embd, std=qk_std)
        add(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd, std=qk_std)
        add(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        if arch == "qwen2":
            add_f32(f"blk.{i}.attn_q.bias", 0.1 * rng.standard_normal(n_embd))
            add_f32(f"blk.{i}.attn_k.bias", 0.1 * rng.standard_normal(n_head_kv * head_dim))
            add_f32(f"blk.{i}.attn_v.bias", 0.1 * rng.standard_normal(n_head_kv * head_dim))
        if arch == "gemma3":
            for name in ("attn_q_norm", "attn_k_norm"):
                add_f32(f"blk.{i}.{name}.weight", 1 + 0.1 * rng.standard_normal(head_dim))
            for name in ("post_attention_norm", "post_ffw_norm"):
                add_f32(f"blk.{i}.{name}.weight", 1 + 0.1 * rng.standard_normal(n_embd))
        add(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        add_f32(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(n_embd))
        add(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        add(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        add(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    add_f32("output_norm.weight", 1 + 0.1 * rng.standard_normal(n_embd))
    if not tied:
        add("output.weight", n_vocab, n_embd, "Q6_K" if n_embd % 256 == 0 else "Q8_0")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def greedy_steps(model, cells, tokens: list[int], chains: list[int], chained: bool) -> list:
    """Greedy steps of every sequence of cells after its token in tokens: for each n in
    chains, n steps as one Transformer.run_chain (chained) or as n passes of run(top_k=1).
    Returns each step's picks, a list per step."""
    from fastrun.runner.batch import Batch

    picks = []
    for steps in chains:
        for _ in range(1 if chained else steps):
            batch = Batch()
            for seq, token in zip(cells.sequences, tokens, strict=True):
                batch.add(seq, [token])
            if chained:
                ids = model.run_chain(batch, cells, steps)
                picks += ids.tolist()
                tokens = ids[-1].tolist()
            else:
                tokens = model.run(batch, cells, top_k=1)[0][:, 0].tolist()
                picks.append(tokens)
    return picks
