"""Regenerate tests/fixtures/hf: tiny random-weight Hugging Face folders and what llama.cpp's
convert_hf_to_gguf.py makes of them.

Not part of CI, and not run with the project's venv: it needs torch and transformers, which
fastrun never depends on. Make a separate venv once:

    python3 -m venv /work/wt/quant-hf-venv
    /work/wt/quant-hf-venv/bin/pip install torch==2.13.0 transformers safetensors sentencepiece
    /work/wt/quant-hf-venv/bin/python scripts/make_hf_fixtures.py \
        --convert .../llama.cpp/convert_hf_to_gguf.py --llama-quantize .../bin/llama-quantize

For each architecture it writes, under tests/fixtures/hf/<name>/, what `save_pretrained` writes
(config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json)
for a 2-layer model with a 384-token byte-level BPE trained on the GPL-3 text, and reference.json:
for each --outtype (f32, f16, bf16, q8_0) the tensors the converter wrote (name, type, shape,
sha256 of the bytes) and the metadata (key -> [GGUF value type, value]), and llama-quantize's
Q4_K_M of the F16 one (what `fastrun quantize DIR --type Q4_K_M` stands for). tests/test_hf_input.py
compares fastrun's conversions against that without torch.

The converter recognises a BPE pre-tokenizer by hashing how it splits a fixed text, so a
vocabulary of its own is "not recognized"; this script tells it the name that the tokenizer's
regex is (`PRE_NAMES`), the same name fastrun's reader derives from that regex.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
TRAINING_TEXT = Path("/usr/share/common-licenses/GPL-3")
OUTTYPES = ["f32", "f16", "bf16", "q8_0"]
VOCAB = 384
# Both models: 2 layers, 4 heads of 16 sharing 2 key/value heads, every row a whole number of
# 32-blocks (Q8_0 needs that); small enough that the fixtures stay well under 1 MB.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp) as tokenizer.json spells them.
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_NAMES = {"tiny-llama": "llama-bpe", "tiny-qwen2": "qwen2"}

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN2_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(regex: str, specials: list[str]):
    """A byte-level BPE of VOCAB tokens whose pre-tokenizer is `regex`, as Llama 3's and
    Qwen2's tokenizer.json are built (Split on the regex, then ByteLevel without its own)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(TRAINING_TEXT)], trainer)
    tok.add_special_tokens(specials)
    return tok


# What differs between the two models; PRE_NAMES says what their regexes are.
MODELS = {
    "tiny-llama": dict(
        classes=("LlamaConfig", "LlamaForCausalLM"),
        regex=LLAMA3_REGEX,
        specials=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        tokenizer=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
        template=LLAMA_TEMPLATE,
        config=dict(
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        seed=18,
        dtype="bfloat16",  # as Llama checkpoints ship
        random_biases=False,
    ),
    "tiny-qwen2": dict(
        classes=("Qwen2Config", "Qwen2ForCausalLM"),
        regex=QWEN2_REGEX,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        tokenizer=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", errors="replace"),
        template=QWEN2_TEMPLATE,
        config=dict(
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        seed=2,
        dtype="float16",  # the other common checkpoint type
        random_biases=True,  # q/k/v biases start at zero; random ones test their row order
    ),
}


def build(folder: Path, spec: dict) -> None:
    """What save_pretrained writes for a tokenizer and a random-weight model of `spec`."""
    import torch
    import transformers

    tok = train_tokenizer(spec["regex"], spec["specials"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **spec["tokenizer"])
    fast.chat_template = spec["template"]
    fast.save_pretrained(folder)
    config_class, model_class = (getattr(transformers, name) for name in spec["classes"])
    config = config_class(
        **SHAPE,
        **spec["config"],
        bos_token_id=tok.token_to_id(spec["bos"]),
        eos_token_id=tok.token_to_id(spec["eos"]),
    )
    torch.manual_seed(spec["seed"])
    model = model_class(config)
    _randomize_norms(model)
    if spec["random_biases"]:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
    model.to(getattr(torch, spec["dtype"])).save_pretrained(folder)


def _randomize_norms(model) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def convert(converter: Path, folder: Path, outtype: str, out: Path, pre: str) -> None:
    """Run convert_hf_to_gguf.py in a child process, naming the pre-tokenizer it cannot hash."""
    wrapper = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(converter.parent)!r}, {str(converter.parent / 'gguf-py')!r}]\n"
        "import conversion.base as base\n"
        "original = base.TextModel.get_vocab_base_pre\n"
        "def named(self, tokenizer):\n"
        "    try:\n"
        "        return original(self, tokenizer)\n"
        "    except NotImplementedError:\n"
        f"        return {pre!r}\n"
        "base.TextModel.get_vocab_base_pre = named\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(folder)!r}, '--outtype', {outtype!r},"
        f" '--outfile', {str(out)!r}]\n"
        f"runpy.run_path({str(converter)!r}, run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", wrapper], check=True, capture_output=True)


def summarize(path: Path, converter: Path) -> dict:
    """Tensors (name, type, shape, sha256) and metadata (key -> [type, value]) of a GGUF."""
    sys.path.insert(0, str(converter.parent / "gguf-py"))
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    metadata = {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue  # the reader's pseudo-fields: version and counts
        vtype = field.types[0]
        value = field.contents()
        metadata[field.name] = [int(vtype), value]
        if vtype == GGUFValueType.ARRAY:
            metadata[field.name] = [int(vtype), value, int(field.types[1])]
    tensors = [
        [
            t.name,
            t.tensor_type.name,
            [int(d) for d in t.shape],
            hashlib.sha256(bytes(t.data.reshape(-1).view("uint8"))).hexdigest(),
        ]
        for t in reader.tensors
    ]
    return {"metadata": metadata, "tensors": tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--convert", type=Path, required=True, help="convert_hf_to_gguf.py")
    parser.add_argument(
        "--llama-quantize",
        type=Path,
        help="llama-quantize: also record its Q4_K_M of the converter's F16 (rows of 64 take "
        "the fallbacks of rows that are not whole 256-blocks)",
    )
    args = parser.parse_args()
    for name, spec in MODELS.items():
        folder = FIXTURES / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        build(folder, spec)
        reference = {"pre_tokenizer_named_by_script": PRE_NAMES[name], "outputs": {}}
        with tempfile.TemporaryDirectory() as tmp:
            for outtype in OUTTYPES:
                out = Path(tmp) / f"{outtype}.gguf"
                convert(args.convert, folder, outtype, out, PRE_NAMES[name])
                reference["outputs"][outtype.upper()] = summarize(out, args.convert)
            if args.llama_quantize is not None:
                out = Path(tmp) / "q4_k_m.gguf"
                subprocess.run(
                    [str(args.llama_quantize), str(Path(tmp) / "f16.gguf"), str(out), "Q4_K_M"],
                    check=True,
                    capture_output=True,
                )
                reference["outputs"]["Q4_K_M"] = summarize(out, args.convert)
        (folder / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{folder.relative_to(ROOT)}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
