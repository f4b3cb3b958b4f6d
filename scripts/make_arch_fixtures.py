"""Regenerate tests/fixtures/arch: tiny random-weight models of each architecture, made in
Hugging Face transformers, converted to GGUF (F32) by llama.cpp's own convert_hf_to_gguf.py,
with transformers' float32 logits for a fixed token sequence beside each (and for phi3 of a
second one, past its original context: LongRoPE's long factors). `--only phi3` regenerates
one fixture.

Needs torch and transformers (not fastrun's test dependencies: the tests read only the
committed files) and a llama.cpp checkout for the converter:

    python -m venv /tmp/fixtures && /tmp/fixtures/bin/pip install torch transformers numpy
    /tmp/fixtures/bin/python scripts/make_arch_fixtures.py --llama-cpp PATH/TO/llama.cpp

The converter's tokenizer step wants a real tokenizer (files, a pre-tokenizer hash it knows);
it is replaced here, and only it, by a plain list of placeholder tokens: the tests compare
logits of token ids, never text.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "arch"
N_VOCAB = 128
N_TOKENS = 24  # longer than the fixtures' 8-position windows, so the masks matter
# A second sequence (npz keys long_ids, long_logits) where the fixture's RoPE depends on the
# sequence: phi3's LongRoPE takes its long factors past original_max_position_embeddings.
LONG_TOKENS = {"phi3": 48}
SEED = 17

# Small shapes: every fixture stays near 200 KB. Rows of two Q8_0 blocks (32 wide, one
# block a row, the Q8_0 check would measure rounding more than a model's use of it).
COMMON = dict(
    vocab_size=N_VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def configs():
    """(fixture name, transformers config class name, config fields) of every fixture."""
    return [
        ("qwen3", "Qwen3Config", dict(COMMON, head_dim=16, rope_theta=1e6)),
        (
            "gemma2",
            "Gemma2Config",
            dict(
                COMMON,
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=8,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0,
                hidden_activation="gelu_pytorch_tanh",
            ),
        ),
        (
            "gemma3",
            "Gemma3TextConfig",
            dict(
                COMMON,
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=8,
                # llama.cpp reads no pattern from gemma3 files: every 6th layer is global, so
                # both layers of this one are local (window 8, RoPE base 10000)
                layer_types=["sliding_attention", "sliding_attention"],
                hidden_activation="gelu_pytorch_tanh",
            ),
        ),
        (
            "phi3",
            "Phi3Config",
            dict(
                COMMON,
                sliding_window=None,
                max_position_embeddings=128,
                original_max_position_embeddings=32,
                # LongRoPE: the short factors apply within the original 32 positions
                rope_scaling=dict(
                    rope_type="longrope",
                    factor=4.0,  # max_position_embeddings / original_max_position_embeddings
                    short_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                    long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0],
                ),
            ),
        ),
        (
            "llama3",
            "LlamaConfig",
            dict(
                COMMON,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    # short, so that the 16-wide heads' wavelengths fall on both sides
                    original_max_position_embeddings=32,
                ),
            ),
        ),
    ]


def randomize(model, torch, zero_centered_norms: bool) -> None:
    """Weights large enough that the logits are far from uniform (transformers' init is
    0.02 std), yet not chaotic (a random net at full gain amplifies Q8_0's rounding far
    beyond a trained one's): matrices ~ N(0, 0.64 / n_in), embeddings ~ N(0, 0.35^2),
    norms around 1 (Gemma's are stored as w - 1)."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:  # norm weights
                p.copy_(0.2 * noise + (0.0 if zero_centered_norms else 1.0))
            elif "embed" in name:  # tied: the output too; logits' std about 3, as real ones
                p.copy_(0.35 * noise)
            else:
                p.copy_(0.8 * noise / p.shape[1] ** 0.5)


def convert(llama_cpp: Path, model_dir: Path, out: Path) -> None:
    """convert_hf_to_gguf.py in this process, its vocabulary step replaced."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    sys.path.insert(0, str(llama_cpp))
    import conversion
    import convert_hf_to_gguf

    def placeholder_vocab(self):
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("default")
        self.gguf_writer.add_token_list([f"<t{i}>" for i in range(N_VOCAB)])
        self.gguf_writer.add_token_types([1] * N_VOCAB)
        self.gguf_writer.add_token_merges([])

    # every architecture's class overrides set_vocab (their modules load on demand): the
    # placeholder goes on each instance, where it wins over any class's
    original_init = conversion.TextModel.__init__

    def init_with_placeholder_vocab(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.set_vocab = types.MethodType(placeholder_vocab, self)

    conversion.TextModel.__init__ = init_with_placeholder_vocab
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", "f32", "--outfile", str(out)]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    parser.add_argument("--only", nargs="*", help="fixture names (default: all)")
    args = parser.parse_args()

    import torch
    import transformers

    OUT.mkdir(parents=True, exist_ok=True)
    for name, config_name, fields in configs():
        if args.only and name not in args.only:
            continue
        config = getattr(transformers, config_name)(**fields)
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.eval()
        randomize(model, torch, zero_centered_norms=name.startswith("gemma"))
        lengths = {"": N_TOKENS} | ({"long_": LONG_TOKENS[name]} if name in LONG_TOKENS else {})
        arrays = {}
        for prefix, n_tokens in lengths.items():
            ids = np.random.default_rng(SEED).integers(0, N_VOCAB, n_tokens).astype(np.int32)
            with torch.no_grad():
                logits = model(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
            arrays[f"{prefix}ids"], arrays[f"{prefix}logits"] = ids, logits.astype(np.float32)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            # gemma3's converter counts the real vocabulary in tokenizer.json
            vocab = {f"<t{i}>": i for i in range(N_VOCAB)}
            tokenizer = {"model": {"vocab": vocab}, "added_tokens": []}
            (Path(tmp) / "tokenizer.json").write_text(json.dumps(tokenizer))
            convert(args.llama_cpp, Path(tmp), OUT / f"{name}.gguf")
        np.savez_compressed(OUT / f"{name}.npz", **arrays)
        size = (OUT / f"{name}.gguf").stat().st_size
        print(f"{name}: {size / 1024:.0f} KB, logits std {arrays['logits'].std():.3f}")


if __name__ == "__main__":
    main()
