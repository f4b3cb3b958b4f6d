"""The GGUF writer: round trips through fastrun's reader and the gguf package's, alignment,
and no file left behind when writing fails."""

import os

import gguf
import numpy as np
import pytest

from fastrun.formats import GGUFFile
from fastrun.formats.errors import FastrunError
from fastrun.formats.writer import (
    ARRAY,
    BOOL,
    FLOAT32,
    INT32,
    STRING,
    UINT32,
    GGUFWriter,
    MetadataValue,
    TensorSpec,
    metadata_of,
)
from fastrun.quant.formats import block_format


def _metadata(alignment=None):
    meta = {
        "general.architecture": MetadataValue(STRING, "llama"),
        "llama.block_count": MetadataValue(UINT32, 2),
        "some.signed": MetadataValue(INT32, -7),
        "some.float": MetadataValue(FLOAT32, 0.5),
        "some.flag": MetadataValue(BOOL, True),
        "some.words": MetadataValue(ARRAY, ["a", "ĠThe", "日本"], STRING),
        "some.numbers": MetadataValue(ARRAY, np.array([1.5, -2.0], np.float32), FLOAT32),
    }
    if alignment:
        meta["general.alignment"] = MetadataValue(UINT32, alignment)
    return meta


def _tensors(rng):
    specs = [
        TensorSpec("a.weight", (64, 3), block_format("Q8_0")),
        TensorSpec("norm.weight", (7,), block_format("F32")),
        TensorSpec("b.weight", (32, 2), block_format("F16")),
    ]
    data = [rng.integers(0, 256, s.n_bytes, dtype=np.uint8) for s in specs]
    return specs, data


@pytest.mark.parametrize("alignment", [None, 64])
def test_round_trip(tmp_path, alignment):
    rng = np.random.default_rng(0)
    specs, data = _tensors(rng)
    path = tmp_path / "out.gguf"
    with GGUFWriter(path, _metadata(alignment), specs) as w:
        for spec, raw in zip(specs, data, strict=True):
            half = raw.size // 2  # a tensor may arrive in parts
            w.write_tensor(spec.name, raw[:half])
            w.write_tensor(spec.name, raw[half:])
    with GGUFFile(path) as f:
        assert f.metadata["some.words"] == ["a", "ĠThe", "日本"]
        assert f.metadata["some.signed"] == -7 and f.metadata["some.flag"] is True
        assert list(f.metadata["some.numbers"]) == [1.5, -2.0]
        assert metadata_of(f)["llama.block_count"].type == UINT32
        for spec, raw in zip(specs, data, strict=True):
            info = f.tensor(spec.name)
            assert info.shape == spec.shape and info.format == spec.format
            assert info.offset % (alignment or 32) == 0
            assert np.array_equal(f.tensor_bytes(spec.name).reshape(-1), raw)
    # the gguf package reads the same file the same way
    r = gguf.GGUFReader(path)
    assert [t.name for t in r.tensors] == [s.name for s in specs]
    assert bytes(r.tensors[0].data.reshape(-1)) == data[0].tobytes()
    assert os.listdir(tmp_path) == ["out.gguf"]


def test_copy_keeps_every_value_and_type(tiny_model, tmp_path):
    with GGUFFile(tiny_model) as src:
        meta = metadata_of(src)
        specs = [TensorSpec(t.name, t.shape, t.format) for t in src.tensors.values()]
        out = tmp_path / "copy.gguf"
        with GGUFWriter(out, meta, specs) as w:
            for s in specs:
                w.write_tensor(s.name, src.tensor_bytes(s.name))
    # a verbatim copy of a file written by the gguf package is byte-identical to it
    assert out.read_bytes() == tiny_model.read_bytes()


def test_failure_leaves_nothing(tmp_path):
    rng = np.random.default_rng(1)
    specs, data = _tensors(rng)
    path = tmp_path / "out.gguf"
    with pytest.raises(RuntimeError):
        with GGUFWriter(path, _metadata(), specs) as w:
            w.write_tensor(specs[0].name, data[0])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []
    with pytest.raises(FastrunError, match="never written"):
        with GGUFWriter(path, _metadata(), specs) as w:
            w.write_tensor(specs[0].name, data[0])
    assert os.listdir(tmp_path) == []
    with pytest.raises(FastrunError, match="expected tensor"):
        with GGUFWriter(path, _metadata(), specs) as w:
            w.write_tensor(specs[1].name, data[1])
    assert os.listdir(tmp_path) == []


class _FullDisk:
    """A file object on a disk with no space left."""

    def write(self, data):
        raise OSError(28, "No space left on device")

    def close(self):
        pass


def test_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    rng = np.random.default_rng(3)
    specs, data = _tensors(rng)
    w = GGUFWriter(tmp_path / "out.gguf", _metadata(), specs)
    with pytest.raises(FastrunError, match="No space left on device"):
        with w:
            w._out._fh.close()
            w._out._fh = _FullDisk()
            w.write_tensor(specs[0].name, data[0])
    assert os.listdir(tmp_path) == []
