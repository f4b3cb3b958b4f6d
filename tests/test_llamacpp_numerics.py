"""Attention and exp as llama.cpp computes them, bit for bit, from its own numbers:
tests/fixtures/llamacpp/gemma3_attention_expf.npz holds its AVX-512 ggml_v_expf on 16,016
inputs (specials and the flush-to-zero range among them) and, from its graph on
Gemma-3-270M Q4_K_M (scripts/llamacpp_dump.py: jsondec's first 12 tokens, layer 0), the
query, key and value rows that its attention took and the output it gave."""

from pathlib import Path

import numba as nb
import numpy as np
import pytest

from fastrun.backends import get_backend
from fastrun.backends.cpu import ops
from fastrun.backends.reference import ggml_expf

FIXTURE = np.load(Path(__file__).parent / "fixtures" / "llamacpp" / "gemma3_attention_expf.npz")


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all())


@nb.njit
def _cpu_expf(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = ops.expf_ggml(x[i])
    return out


@pytest.mark.parametrize("implementation", ["cpu", "reference"])
def test_expf_is_ggml_v_expf(implementation):
    exp = _cpu_expf if implementation == "cpu" else ggml_expf
    assert same_bits(exp(FIXTURE["expf_x"]), FIXTURE["expf_y"])


def _attention(backend_name, ring=0, offset=0):
    """The fixture's attention on a backend: its 12 tokens at positions 0..11, stored
    from row 3 (or on a ring of `ring` rows from row 3, its positions shifted by offset)."""
    backend = get_backend(backend_name)
    q, k, v = FIXTURE["q"], FIXTURE["k"], FIXTURE["v"]
    n = q.shape[0]
    positions = np.arange(n, dtype=np.int32)
    k_cache, v_cache = np.zeros((2, 32, *k.shape[1:]), np.float32)
    starts = np.full(n, 3, np.int32)
    offsets = np.full(n, offset, np.int32)
    rows = starts + ((positions + offset) % ring if ring else positions)
    backend.kv_write(k_cache, v_cache, k, v, rows)
    return backend.attention(
        q, k_cache, v_cache, positions, float(FIXTURE["scale"]), starts=starts, window=512,
        ring=ring, offsets=offsets,
    )  # fmt: skip


@pytest.mark.parametrize("implementation", ["cpu", "reference"])
def test_attention_is_llamacpps_bit_for_bit(implementation):
    assert same_bits(_attention(implementation), FIXTURE["kqv_out"])


@pytest.mark.parametrize("offset", [0, 5, 9])
def test_attention_on_a_ring_is_the_same(offset):
    """A sliding-window layer's ring that wraps mid-sequence visits the same positions in the
    same order: the same bits."""
    assert same_bits(_attention("cpu", ring=16, offset=offset), FIXTURE["kqv_out"])


@pytest.mark.parametrize("heads", [(12, 2, 128), (14, 2, 64), (9, 3, 64), (4, 1, 256)])
@pytest.mark.parametrize("ring", [0, 48])
def test_attention_is_the_same_whatever_its_tasks(heads, ring):
    """The query heads of a KV head in one task (their K rows' dot products interleaved, V
    rows shared) or one head a task, as the thread count picks: the same bits, so they
    equal the fixture's wherever llama.cpp's order holds."""
    h, hk, hd = heads
    rng = np.random.default_rng(hd + h)
    n, rows = 5, 160
    k_cache, v_cache = rng.standard_normal((2, rows, hk, hd)).astype(np.float16).astype(np.float32)
    q = rng.standard_normal((n, h, hd)).astype(np.float32)
    positions = np.arange(90, 90 + n, dtype=np.int32)
    starts, offsets = np.full(n, 7, np.int32), np.full(n, 3, np.int32)
    window = 40 if ring else 0
    outs = []
    for threads in (1, n * hk + 1):  # grouped heads, then one head a task
        out = np.empty((n, h, hd), np.float32)
        args = (np.float32(hd**-0.5), window, np.float32(0), ring, offsets, threads, out)
        ops.attention(q, k_cache, v_cache, positions, starts, *args)
        outs.append(out)
    assert same_bits(outs[0], outs[1])


def test_one_token_at_a_time_is_the_same():
    """Decode steps (one query against the cache so far) give a prefill's bits."""
    backend = get_backend("cpu")
    q, k, v = FIXTURE["q"], FIXTURE["k"], FIXTURE["v"]
    k_cache, v_cache = np.zeros((2, 32, *k.shape[1:]), np.float32)
    backend.kv_write(k_cache, v_cache, k, v, np.arange(q.shape[0], dtype=np.int32))
    rows = [
        backend.attention(q[t : t + 1], k_cache, v_cache, np.array([t], np.int32), 1 / 16)[0]
        for t in range(q.shape[0])
    ]
    assert same_bits(np.stack(rows), FIXTURE["kqv_out"])


# Products and RoPE, from llama.cpp's graph on Gemma-3-270M Q4_K_M and SmolLM2-135M Q4_1
# (scripts/llamacpp_dump.py --products-fixture: jsondec's first 16 tokens in one batch, 4
# kept): the inputs it took and the outputs it gave, for a weight of each format the models
# have (its tinyBLAS Q5_0 and Q8_0, vec_dot Q4_1, repacked Q4_K, tiled Q6_K) and for RoPE
# (Gemma's halves at both bases, SmolLM2's pairs).
def _products(model):
    return np.load(Path(__file__).parent / "fixtures" / "llamacpp" / f"{model}_products.npz")


PRODUCTS = {"gemma3": _products("gemma3"), "smollm2": _products("smollm2")}
MODELS = {"gemma3": "gemma3-270m", "smollm2": "smollm2-135m-instruct"}
ROPES = {  # fixture: (base, neox)
    ("gemma3", "rope_local"): (10_000.0, True),
    ("gemma3", "rope_global"): (1e6, True),
    ("smollm2", "rope_pairs"): (100_000.0, False),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def gguf(request):
    from helpers import real_model

    from fastrun.formats.gguf import GGUFFile

    return request.param, GGUFFile(real_model(MODELS[request.param]))


def test_products_are_llamacpps_bit_for_bit(gguf):
    model, f = gguf
    fixture = PRODUCTS[model]
    names = [k[: -len(".weight")] for k in fixture.files if k.endswith(".weight")]
    products = [n for n in names if str(fixture[f"{n}.weight"])]
    assert products
    backend = get_backend("cpu")
    for product in products:
        info = f.tensor(str(fixture[f"{product}.weight"]))
        assert info.format.name == product.upper()
        n_out, n_in = info.matrix_shape
        w = backend.load_weight(f.tensor_bytes(info.name), info.format.name, n_out, n_in)
        x, y = fixture[f"{product}.x"], fixture[f"{product}.y"]
        assert same_bits(backend.matmul(x, w), y), product
        # one token alone too: the order does not depend on the batch
        assert same_bits(backend.matmul(x[1:2], w)[0], y[1]), product


@pytest.mark.parametrize(("model", "rope"), sorted(ROPES))
@pytest.mark.parametrize("implementation", ["cpu", "reference"])
def test_rope_is_llamacpps_bit_for_bit(implementation, model, rope):
    from fastrun.backends.base import RopeConfig

    base, neox = ROPES[model, rope]
    x = np.array(PRODUCTS[model][f"{rope}.x"], np.float32)  # [tokens, heads, hd]
    config = RopeConfig(n_dims=x.shape[2], freq_base=base, neox=neox)
    got = get_backend(implementation).rope(x, np.arange(x.shape[0], dtype=np.int32), config)
    assert same_bits(got, PRODUCTS[model][f"{rope}.y"])
