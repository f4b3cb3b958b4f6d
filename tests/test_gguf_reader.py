"""GGUF reader: real files, zero-copy views, and a fuzz run over mutated and truncated copies."""

import time

import numpy as np
import pytest

from fastrun.formats import GGUFError, GGUFFile
from fastrun.formats.gguf import _U64


def test_reads_smollm2(smollm2_path):
    with GGUFFile(smollm2_path) as f:
        assert f.architecture == "llama"
        assert f.get("{arch}.block_count") == 30
        assert len(f.get("tokenizer.ggml.tokens")) == 49152
        info = f.tensor("blk.0.ffn_down.weight")
        assert info.format.name == "Q4_1" and info.shape == (1536, 576)
        view = f.tensor_bytes("blk.0.ffn_down.weight")
        assert view.shape == (576, 1536 // 32 * 20)
        assert not view.flags.writeable
        assert np.shares_memory(view, f._data)  # a view of the map, not a copy


def test_tiny_model_roundtrip(tiny_model):
    with GGUFFile(tiny_model) as f:
        assert f.get("{arch}.embedding_length") == 256
        assert f.tensor("blk.0.attn_q.weight").format.name == "Q4_0"
        assert f.tensor_bytes("blk.1.ffn_down.weight").shape == (256, 512 // 32 * 18)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: b"GGML" + b[4:], "bad magic"),
        (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "version 7"),
        (lambda b: b[:8] + (1 << 60).to_bytes(8, "little") + b[16:], "absurd counts"),
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b[:10], "not a GGUF"),
    ],
)
def test_bad_files_give_clear_errors(tiny_model, tmp_path, edit, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(edit(tiny_model.read_bytes()))
    with pytest.raises(GGUFError, match=message):
        GGUFFile(bad)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="directory"):
        GGUFFile(tmp_path)


def _tensor_type_offset(data: bytes, name: str) -> int:
    """Byte offset of the type field of tensor `name` in the tensor table."""
    enc = name.encode()
    pos = data.index(_U64.pack(len(enc)) + enc) + 8 + len(enc)
    n_dims = int.from_bytes(data[pos : pos + 4], "little")
    return pos + 4 + 8 * n_dims


def test_unknown_type_and_partial_block(tiny_model, tmp_path):
    data = bytearray(tiny_model.read_bytes())
    at = _tensor_type_offset(bytes(data), "blk.0.attn_q.weight")
    data[at : at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "type.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="unknown tensor type 99"):
        GGUFFile(bad)
    data = bytearray(tiny_model.read_bytes())
    at = _tensor_type_offset(bytes(data), "blk.0.attn_q.weight")
    dims_at = at - 16  # two dimensions before the type: make the row 250 wide
    data[dims_at : dims_at + 8] = (250).to_bytes(8, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="whole number"):
        GGUFFile(bad)


def test_fuzz_mutated_and_truncated(tiny_model, tmp_path):
    """Thousands of damaged copies: each loads or raises GGUFError; nothing else, quickly."""
    rng = np.random.default_rng(1234)
    original = tiny_model.read_bytes()
    header_end = original.index(b"blk.1.ffn_down.weight") + 64  # mutate where the parser reads
    path = tmp_path / "fuzz.gguf"
    deadline = time.monotonic() + 60
    outcomes = {"loaded": 0, "rejected": 0}
    for i in range(3000):
        data = bytearray(original)
        kind = i % 3
        if kind == 0:  # flip a few bytes in the header region
            for _ in range(rng.integers(1, 8)):
                data[rng.integers(0, header_end)] = rng.integers(0, 256)
        elif kind == 1:  # plant a huge 64-bit value
            at = int(rng.integers(0, header_end - 8))
            data[at : at + 8] = int(rng.integers(1 << 40, 1 << 63)).to_bytes(8, "little")
        else:  # truncate
            data = data[: rng.integers(0, len(data))]
        path.write_bytes(bytes(data))
        try:
            with GGUFFile(path) as f:
                for name in f.tensors:
                    f.tensor_bytes(name)
            outcomes["loaded"] += 1
        except GGUFError:
            outcomes["rejected"] += 1
        assert time.monotonic() < deadline, f"fuzzing too slow after {i} cases"
    assert outcomes["rejected"] > 1000
