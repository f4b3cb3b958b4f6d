"""`fastrun quantize`: fast quantizers against the NumPy reference, llama-quantize's per-tensor
recipes, the converted file, and bad input (one line, exit 2 / 130, nothing left behind)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import write_tiny_model

from fastrun.formats import GGUFFile
from fastrun.quant.fast_quantize import quantize_rows
from fastrun.quant.float_types import widen_f16
from fastrun.quant.numpy_quantize import BLOCK_BYTES, HALF_BELOW, quantize_blocks32
from fastrun.quant.reference import dequantize_ref, quantize_ref
from fastrun.runner.cli import main

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _awkward_rows(rng) -> np.ndarray:
    """Rows of mixed scales with the edge cases of the scale searches: all zero, constant,
    all positive, one outlier, a zero sub-block, tiny values."""
    x = rng.standard_normal((24, 512)).astype(np.float32) * rng.random((24, 1)).astype(np.float32)
    x[0] = 0
    x[1] = 0.25
    x[2] = np.abs(x[2])
    x[3, 7] = 50
    x[4, :32] = 0
    x[5] *= 1e-6
    return x


@pytest.mark.parametrize("qtype", TYPES)
def test_fast_quantizer_matches_reference(qtype):
    x = _awkward_rows(np.random.default_rng(0))
    fast = quantize_rows(x, qtype)
    ref = quantize_ref(x, qtype).reshape(fast.shape)
    assert np.array_equal(fast, ref)
    err = np.abs(dequantize_ref(fast, qtype, x.size).reshape(x.shape) - x).mean()
    assert err < 0.1 * np.abs(x).mean()


@pytest.mark.parametrize("qtype", BLOCK_BYTES)
def test_numpy_quantizer_matches_numba(qtype):
    """The NumPy path of the 32-blocks is the Numba kernels' bytes (they are llama.cpp's), from
    float32 and from float16, on awkward rows plus ties and signed zeros."""
    rng = np.random.default_rng(1)
    x = _awkward_rows(rng)
    x[6] = np.round(x[6] * 4) / 4  # many values of equal magnitude and opposite signs
    x[7, :32] = np.where(rng.random(32) < 0.5, -0.0, 0.0)  # a block of signed zeros...
    x[7, 31] = 1  # ...whose min is a zero
    x[8, :32] = np.where(rng.random(32) < 0.5, -0.0, 0.0)
    x[8, 0] = -1  # ...whose max is a zero
    x[9, :32] = -0.0
    assert np.array_equal(quantize_blocks32(x, qtype), quantize_rows(x, qtype))
    h = x.astype(np.float16)
    assert np.array_equal(quantize_blocks32(h, qtype), quantize_rows(h.astype(np.float32), qtype))


def test_numpy_roundf_is_half_away_from_zero():
    """trunc(v + HALF_BELOW) is C's roundf at and around every tie up to 128 (the whole range
    of float32 is checked by scripts/check_roundf.py)."""
    ties = np.arange(256, dtype=np.float32) / 2
    v = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, 200)])
    v = np.concatenate([v, -v, [np.nextafter(np.float32(0.5), 0)]]).astype(np.float32)
    exact = np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)
    assert np.array_equal(np.trunc(v + np.copysign(HALF_BELOW, v)), exact)


def test_widen_f16_is_numpys_cast():
    """The bit-arithmetic F16 widening gives NumPy's float32 for every half: subnormals, zeros
    of both signs, and (through the fallback) infinities and NaNs."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    for h in (halves[np.isfinite(halves)], halves):
        out = widen_f16(h, np.empty(h.size, np.float32))
        assert np.array_equal(out.view(np.uint32), h.astype(np.float32).view(np.uint32))


def test_plain_types_import_no_numba(f32_model, tmp_path):
    """Q8_0 and the other 32-blocks from a float model run on NumPy alone: no Numba import,
    and no pydantic (which some typer versions import to check the arguments)."""
    code = textwrap.dedent(
        f"""
        import sys
        from fastrun.runner.cli import main
        assert main(["quantize", {str(f32_model)!r}, {str(tmp_path / "q.gguf")!r},
                     "--type", "Q8_0"]) == 0
        assert "numba" not in sys.modules, "numba imported"
        assert "pydantic" not in sys.modules, "pydantic imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_float_types():
    x = np.array([[1.0, -2.5, 3.1e-5, 65519.0, np.inf, -0.0]], np.float32)
    assert np.array_equal(quantize_rows(x, "F16").view("<f2"), x.astype(np.float16))
    bf = quantize_rows(np.array([[1.0, 1.00390625, 1.01171875]], np.float32), "BF16")
    assert list(bf.view("<u2")[0]) == [0x3F80, 0x3F80, 0x3F82]  # ties round to even


def _types(path) -> dict[str, str]:
    with GGUFFile(path) as f:
        return {name: t.format.name for name, t in f.tensors.items()}


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("quant") / "f32.gguf", qtype="F32", n_layer=8, n_ff=512
    )


def test_q4_k_m_recipe(f32_model, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(f32_model), str(out), "--type", "q4_k_m"]) == 0
    summary = capsys.readouterr().out
    assert "bits per weight" in summary and "Q4_K" in summary
    types = _types(out)
    more_bits = [0, 3, 6, 7]  # llama.cpp's use_more_bits for 8 layers
    for i in range(8):
        expect = "Q6_K" if i in more_bits else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == expect
        assert types[f"blk.{i}.ffn_down.weight"] == expect
        assert types[f"blk.{i}.attn_q.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == "Q6_K"  # tied embedding: the output's type
    with GGUFFile(out) as f:
        assert f.metadata["general.file_type"] == 15
        assert f.metadata["general.quantization_version"] == 2
        assert list(f.metadata)[-2:] == ["general.quantization_version", "general.file_type"]
        # the data is what the quantizer makes of the input's floats
        with GGUFFile(f32_model) as src:
            x = src.tensor_bytes("blk.1.attn_q.weight").view("<f4")
            assert np.array_equal(f.tensor_bytes("blk.1.attn_q.weight"), quantize_rows(x, "Q4_K"))


def test_fallback_for_rows_not_a_multiple_of_256(tmp_path, capsys):
    src = write_tiny_model(tmp_path / "f32.gguf", qtype="F32", n_embd=96, n_head=2, n_ff=256)
    out = tmp_path / "s.gguf"
    assert main(["quantize", str(src), str(out), "--type", "Q4_K_S"]) == 0
    types = _types(out)
    assert types["blk.0.attn_q.weight"] == "Q5_0"  # Q4_K does not fit 96: Q5_0
    assert types["blk.0.attn_v.weight"] == "Q5_1"  # Q4_K_S's first attn_v: Q5_K -> Q5_1
    assert types["blk.0.ffn_down.weight"] == "Q4_K"  # rows of 256 keep the K-quant
    assert types["token_embd.weight"] == "Q8_0"


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q5_1"])
def test_plain_types_load(f32_model, tmp_path, qtype):
    out = tmp_path / f"{qtype}.gguf"
    assert main(["quantize", str(f32_model), str(out), "--type", qtype, "-t", "2"]) == 0
    types = _types(out)
    embedding = types.pop("token_embd.weight")  # tied: the output's Q6_K unless Q8_0 or float
    assert embedding == (qtype if qtype in ("F16", "BF16", "Q8_0") else "Q6_K")
    assert set(types.values()) == {qtype, "F32"}


def _one_error_line(capsys, message):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fastrun: error: ") and message in err[0], err


def test_bad_input(f32_model, tiny_model, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    assert main(["quantize", str(f32_model), str(out), "--type", "Q3_X"]) == 2
    _one_error_line(capsys, "unknown type 'Q3_X'")
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("hello " * 100)
    assert main(["quantize", str(not_gguf), str(out), "--type", "Q8_0"]) == 2
    _one_error_line(capsys, "not a GGUF file")
    assert main(["quantize", str(tiny_model), str(out), "--type", "Q8_0"]) == 2
    _one_error_line(capsys, "--allow-requantize")
    assert main(["quantize", str(tmp_path), str(out), "--type", "Q8_0"]) == 2
    _one_error_line(capsys, "is a folder")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
    out.write_bytes(b"keep me")
    assert main(["quantize", str(f32_model), str(out), "--type", "Q8_0"]) == 2
    _one_error_line(capsys, "--force")
    assert out.read_bytes() == b"keep me"
    assert main(["quantize", str(f32_model), str(out), "--type", "Q8_0", "--force"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "out.gguf"]


def test_requantize_allowed(tiny_model, tmp_path):
    out = tmp_path / "re.gguf"
    args = ["quantize", str(tiny_model), str(out), "--type", "Q8_0", "--allow-requantize"]
    assert main(args) == 0
    assert set(_types(out).values()) == {"Q8_0", "F32"}


def test_ctrl_c_leaves_nothing(f32_model, tmp_path):
    """A real SIGINT mid-way: exit 130, one line, no output and no temporary file."""
    out = tmp_path / "out.gguf"
    script = textwrap.dedent(f"""
        import sys, time
        import fastrun.quant.pipeline as pipeline
        real = pipeline.quantize_blocks32  # Q8_0's quantizer
        def slow(x, t):
            print("started", flush=True)
            time.sleep(0.5)
            return real(x, t)
        pipeline.quantize_blocks32 = slow
        from fastrun.runner.cli import main
        sys.exit(main(["quantize", {str(f32_model)!r}, {str(out)!r}, "--type", "Q8_0", "-t", "1"]))
    """)
    p = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "started"
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def _choose(ftype, n_layer=16, tied=False, arch="llama", n_expert=0):
    from fastrun.quant.formats import block_format
    from fastrun.quant.recipes import TypeChooser, file_type, llama_order

    names = ["token_embd.weight", "output_norm.weight"] + (["output.weight"] if not tied else [])
    for i in range(n_layer):
        names += [f"blk.{i}.{t}.weight" for t in ("attn_v", "attn_k", "attn_output", "ffn_down")]
    names = llama_order(names)
    chooser = TypeChooser(file_type(ftype), names, arch, n_layer, n_expert)
    f16 = block_format("F16")
    shape = {n: (512,) if "norm" in n else (512, 512) for n in names}
    return {n: chooser.choose(n, shape[n], f16).name for n in names}


def test_recipe_rules():
    t = _choose("Q5_K_M")
    assert t["output.weight"] == "Q6_K" and t["token_embd.weight"] == "Q5_K"  # untied
    assert t["output_norm.weight"] == "F16"  # 1-D: kept as it is
    more = [i for i in range(16) if t[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]  # use_more_bits for 16 layers
    assert [i for i in range(16) if t[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == more
    t = _choose("Q4_K_S")
    assert [i for i in range(16) if t[f"blk.{i}.attn_v.weight"] == "Q5_K"] == [0, 1, 2, 3]
    assert [i for i in range(16) if t[f"blk.{i}.ffn_down.weight"] == "Q5_K"] == [0, 1]
    t = _choose("Q4_K_M", n_expert=8)
    assert t["blk.3.attn_v.weight"] == "Q8_0" and t["blk.3.attn_k.weight"] == "Q8_0"
    assert t["blk.3.attn_output.weight"] == "Q5_K"
    t = _choose("Q4_K_M", arch="falcon")
    assert t["output.weight"] == "Q8_0" and t["blk.0.ffn_down.weight"] == "Q6_K"
    assert t["blk.1.ffn_down.weight"] == "Q5_K" and t["blk.2.ffn_down.weight"] == "Q4_K"
    t = _choose("Q8_0", tied=True)
    assert set(t.values()) == {"Q8_0", "F16"}
