"""`fastrun quantize` from a Hugging Face folder against llama.cpp's convert_hf_to_gguf.py.

tests/fixtures/hf holds tiny random-weight models saved by transformers (llama in bf16, qwen2
in f16 with tied embeddings and q/k/v biases) and what the converter wrote for each --outtype
(reference.json, made by scripts/make_hf_fixtures.py), and llama-quantize's Q4_K_M of the
converter's F16: the same tensors, types, bytes and metadata are expected, without torch or
transformers here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from fastrun.formats import GGUFFile
from fastrun.formats.errors import FastrunError
from fastrun.formats.hf_model import HFModel, rotary_row_order, size_label
from fastrun.quant.pipeline import quantize_model

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MODELS = ["tiny-llama", "tiny-qwen2"]


def _summary(path: Path) -> dict:
    """The same summary as make_hf_fixtures.py's, read with fastrun's reader."""
    with GGUFFile(path) as f:
        metadata = {}
        for key, (vtype, item_type, _) in f.metadata_types.items():
            value = f.metadata[key]
            value = value.tolist() if isinstance(value, np.ndarray) else value
            metadata[key] = [vtype, value] + ([item_type] if item_type is not None else [])
        tensors = [
            [
                t.name,
                t.format.name,
                list(t.shape),
                hashlib.sha256(f.tensor_bytes(t.name).tobytes()).hexdigest(),
            ]
            for t in f.tensors.values()
        ]
    return {"metadata": metadata, "tensors": tensors}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("outtype", ["F32", "F16", "BF16", "Q8_0", "Q4_K_M"])
def test_same_file_as_convert_hf_to_gguf(model, outtype, tmp_path):
    reference = json.loads((FIXTURES / model / "reference.json").read_text())
    expected = reference["outputs"][outtype]
    out = tmp_path / "out.gguf"
    quantize_model(FIXTURES / model, out, outtype)
    ours = _summary(out)
    assert [t[:3] for t in ours["tensors"]] == [t[:3] for t in expected["tensors"]]
    for a, b in zip(ours["tensors"], expected["tensors"], strict=True):
        assert a[3] == b[3], f"{a[0]}: bytes differ"
    assert set(ours["metadata"]) == set(expected["metadata"])
    for key, value in expected["metadata"].items():
        assert ours["metadata"][key] == value, key


@pytest.mark.parametrize("model", MODELS)
def test_output_loads_and_runs(model, tmp_path):
    import fastrun

    out = tmp_path / "q.gguf"
    quantize_model(FIXTURES / model, out, "Q8_0")
    llm = fastrun.load(str(out), n_ctx=64, threads=1)
    ids = llm.tokenize("the Program, you")
    assert llm.detokenize(ids) == "the Program, you"
    assert np.isfinite(llm.logprobs(ids)).all()
    reply = "".join(llm.chat([{"role": "user", "content": "hi"}], temperature=0, max_tokens=3))
    assert isinstance(reply, str)


def test_rotary_row_order():
    # two heads of 4 rows: each head's halves [0 1 | 2 3] interleave to [0 2 1 3]
    assert rotary_row_order(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert size_label(110912) == "111K"
    assert size_label(134_515_008) == "135M"


def _copy(model: str, tmp_path: Path) -> Path:
    folder = tmp_path / model
    shutil.copytree(FIXTURES / model, folder)
    (folder / "reference.json").unlink()
    return folder


def _rewrite_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "not one fastrun converts"),
        ({"num_attention_heads": "4"}, "num_attention_heads is '4'"),
        ({"num_hidden_layers": -1}, "num_hidden_layers is -1"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1.0}}, "RoPE type 'su'"),
        ({"num_local_experts": 8}, "mixture-of-experts"),
    ],
)
def test_bad_config(tmp_path, change, message):
    folder = _copy("tiny-llama", tmp_path)
    _rewrite_config(folder, **change)
    with pytest.raises(FastrunError, match=message):
        HFModel(folder)


def test_bad_safetensors(tmp_path):
    folder = _copy("tiny-qwen2", tmp_path)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 2  # overlaps the next tensor
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(FastrunError, match="not a valid safetensors file"):
        HFModel(folder)
    weights.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(FastrunError, match="not a valid safetensors file"):
        HFModel(folder)


def test_missing_pieces(tmp_path):
    folder = _copy("tiny-qwen2", tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FastrunError, match="no tokenizer.json"):
        HFModel(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FastrunError, match="no model.*safetensors"):
        HFModel(folder)
