"""The parity harness: every backend operation against the NumPy reference backend.

A new backend op is not done until it has a case here. GPU cases skip without CuPy or a GPU.
"""

import zlib
from functools import partial

import numpy as np
import pytest
from helpers import random_blocks

from fastrun.backends import RopeConfig, get_backend
from fastrun.backends.cuda import cuda_available
from fastrun.backends.reference import ReferenceBackend

BACKENDS = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not cuda_available(), reason="no CUDA GPU")),
]
WEIGHT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "F32"]

ref = ReferenceBackend()


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return get_backend(request.param)


def seed_of(*parts) -> int:
    """A seed that is the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode())


def host(backend, x):
    return np.asarray(backend.to_host(x))


def dev(backend, x):
    """A host array onto the backend, through the only door the contract has for activations."""
    return backend.load_vector(x.reshape(-1)).reshape(x.shape)


@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
@pytest.mark.parametrize("n", [1, 3, 16, 17])
def test_matmul(backend, qtype, n):
    check_matmul(backend, qtype, n, 48, 512, np.random.default_rng(seed_of(qtype, n)))


@pytest.mark.parametrize(
    "qtype, n_in", [("Q4_0", 288), ("Q8_0", 288), ("Q4_0", 3328), ("Q4_K", 3328), ("Q6_K", 3328)]
)
def test_matmul_row_lengths(backend, qtype, n_in):
    """Rows of a part of a 256-weight chunk (CUDA: not the tensor-core kernel) and of many
    chunks (more than its copy ring holds per warp), at a decode batch's 16 tokens."""
    check_matmul(backend, qtype, 16, 40, n_in, np.random.default_rng(seed_of(qtype, n_in)))


def check_matmul(backend, qtype, n, n_out, n_in, rng):
    """backend.matmul of n random rows with a random weight against the NumPy reference."""
    raw = random_blocks(qtype, n_out, n_in, rng)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    expect = ref.matmul(x, ref.load_weight(raw, qtype, n_out, n_in))
    got = host(
        backend, backend.matmul(dev(backend, x), backend.load_weight(raw, qtype, n_out, n_in))
    )
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4 * np.abs(expect).max())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "F16"])
def test_embed(backend, qtype):
    rng = np.random.default_rng(5)
    raw = random_blocks(qtype, 40, 256, rng)
    ids = np.array([3, 0, 39, 3], np.int32)
    expect = ref.embed(ref.load_weight(raw, qtype, 40, 256), ids)
    got = host(backend, backend.embed(backend.load_weight(raw, qtype, 40, 256), ids))
    np.testing.assert_array_equal(got, expect)


def test_rms_norm(backend):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 576)).astype(np.float32) * 3
    w = rng.standard_normal(576).astype(np.float32)
    got = host(backend, backend.rms_norm(dev(backend, x), backend.load_vector(w), 1e-5))
    np.testing.assert_allclose(got, ref.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("factors", [False, True])
def test_rope(backend, neox, factors):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 2, 100, 4000, 31000], np.int32)
    ff = (1 + rng.random(32)).astype(np.float32) if factors else None
    cfg = RopeConfig(n_dims=64, freq_base=1e6 if neox else 1e4, neox=neox, freq_factors=ff)
    expect = ref.rope(x.copy(), pos, cfg)
    got = host(backend, backend.rope(dev(backend, x), pos, cfg))
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)


def test_silu_mul_add_bias(backend):
    rng = np.random.default_rng(8)
    g, u = rng.standard_normal((2, 4, 100)).astype(np.float32) * 4
    b = rng.standard_normal(100).astype(np.float32)
    got = host(backend, backend.silu_mul(dev(backend, g), dev(backend, u)))
    np.testing.assert_allclose(got, ref.silu_mul(g, u), rtol=1e-5, atol=1e-6)
    x = dev(backend, g)
    got = host(backend, backend.add_bias(backend.add(x, dev(backend, u)), backend.load_vector(b)))
    np.testing.assert_allclose(got, g + u + b, rtol=1e-6)


def assert_attention_close(got, expect, v):
    """Attention outputs equal up to the fp16 rounding of the softmax's probabilities (the
    reference and the CPU round them as llama.cpp does, CUDA does not): one probability that
    rounds the other way moves an output by at most 2^-11 of the largest |v|."""
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=2.0**-11 * float(np.abs(v).max()))


@pytest.mark.parametrize("n, group", [(1, 3), (9, 3), (9, 1), (40, 7)])
def test_kv_write_and_attention(backend, n, group):
    rng = np.random.default_rng(9 + n)
    hk, hd, c = 2, 64, 64
    h = hk * group
    start = 5
    k_ref, v_ref = ref.zeros((c, hk, hd)), ref.zeros((c, hk, hd))
    k_dev, v_dev = backend.zeros((c, hk, hd)), backend.zeros((c, hk, hd))
    # earlier tokens already in the cache, then n new ones
    for first, count in ((0, start), (start, n)):
        k = rng.standard_normal((count, hk, hd)).astype(np.float32)
        v = rng.standard_normal((count, hk, hd)).astype(np.float32)
        slots = np.arange(first, first + count, dtype=np.int32)
        ref.kv_write(k_ref, v_ref, k, v, slots)
        backend.kv_write(k_dev, v_dev, dev(backend, k), dev(backend, v), slots)
    np.testing.assert_array_equal(host(backend, k_dev), k_ref)
    q = rng.standard_normal((n, h, hd)).astype(np.float32)
    pos = np.arange(start, start + n, dtype=np.int32)
    expect = ref.attention(q, k_ref, v_ref, pos, hd**-0.5)
    got = host(backend, backend.attention(dev(backend, q), k_dev, v_dev, pos, hd**-0.5))
    assert_attention_close(got, expect, v_ref)


def test_portable_kernels_without_avx2(tmp_path):
    """The generic-IR path (CPUs without AVX2) gives the same products, in a fresh process
    with its own kernel cache."""
    import os
    import subprocess
    import sys

    code = """
import sys
import numpy as np
sys.path.insert(0, "tests")
from helpers import random_blocks
from fastrun.backends import get_backend
from fastrun.backends.cpu import simd
from fastrun.backends.reference import ReferenceBackend
assert not simd.HAS_AVX2
cpu, ref, rng = get_backend("cpu"), ReferenceBackend(), np.random.default_rng(0)
for q in ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]:
    raw, x = random_blocks(q, 8, 512, rng), rng.standard_normal((5, 512)).astype(np.float32)
    a = cpu.matmul(x, cpu.load_weight(raw, q, 8, 512))
    b = ref.matmul(x, ref.load_weight(raw, q, 8, 512))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
"""
    env = dict(os.environ, FASTRUN_PORTABLE="1", NUMBA_CACHE_DIR=str(tmp_path))
    env["FASTRUN_PORTABLE_HALF"] = "0"  # and the scalar fp16 rounding of hosts without F16C
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_0", "Q8_0"), ("Q4_1", "Q4_K")])
def test_matmul_many(backend, types):
    rng = np.random.default_rng(11)
    shapes = [(64, 512), (32, 512), (48, 512)][: len(types)]
    raws = [random_blocks(q, o, i, rng) for q, (o, i) in zip(types, shapes, strict=False)]
    x = rng.standard_normal((5, 512)).astype(np.float32)
    got = backend.matmul_many(
        dev(backend, x),
        [
            backend.load_weight(r, q, o, i)
            for r, q, (o, i) in zip(raws, types, shapes, strict=False)
        ],
    )
    for r, q, (o, i), g in zip(raws, types, shapes, got, strict=False):
        expect = ref.matmul(x, ref.load_weight(r, q, o, i))
        np.testing.assert_allclose(
            host(backend, g), expect, rtol=1e-4, atol=1e-4 * np.abs(expect).max()
        )


@pytest.mark.parametrize(
    "qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "F32"]
)
def test_each_row_of_a_product_is_the_product_of_that_row_alone(qtype):
    """CPU batch invariance at the kernel: a row's product has the same bits alone, in a
    4-row group of a tile product or among its 1-3 leftovers; 44 outputs: a tile of 8 rows with
    4 padding rows (tiles.py; float weights: a tile of 32 and one of 12 rows and 20 padding,
    float_tiles.py), the padding sliced off."""
    cpu = get_backend("cpu")
    rng = np.random.default_rng(seed_of(qtype, "rows"))
    raw = random_blocks(qtype, 44, 512, rng)
    x = rng.standard_normal((11, 512)).astype(np.float32)
    w = cpu.load_weight(raw, qtype, 44, 512)
    together = cpu.matmul(x, w)
    assert together.shape == (11, 44)
    for i in range(len(x)):
        np.testing.assert_array_equal(cpu.matmul(x[i : i + 1], w)[0], together[i])
    for n in (2, 5, 10):  # the leftovers of a 4-row group: one, two and three rows
        np.testing.assert_array_equal(cpu.matmul(x[:n], w), together[:n])
    expect = ref.matmul(x, ref.load_weight(raw, qtype, 44, 512))
    np.testing.assert_allclose(together, expect, rtol=1e-4, atol=1e-4 * np.abs(expect).max())


@pytest.mark.parametrize("group", [4, 8])
def test_tiles_hold_eight_rows_interleaved_a_few_values_at_a_time(group, monkeypatch):
    """The repacked layout (tiles.py): Q8_0 values of rows r at bytes 16 + 8 group c + group r..
    (chunk c of `group` values a row: 4 values, or 8 where the host takes wide lanes)."""
    from fastrun.backends.cpu import tiles

    monkeypatch.setattr(tiles, "WIDE_LANES", group == 8)
    rows_of, units_of = tiles._permutation("Q8_0")
    monkeypatch.setitem(tiles._PERMUTATIONS, "Q8_0", (rows_of, units_of))
    raw = random_blocks("Q8_0", 8, 64, np.random.default_rng(3))
    first_block = tiles.repack(raw, "Q8_0")[0, : 8 * 34]
    for r in range(8):
        np.testing.assert_array_equal(first_block[2 * r : 2 * r + 2], raw[r, 0:2])  # d
        for c in range(32 // group):
            at = 16 + 8 * group * c + group * r
            values = raw[r, 2 + group * c : 2 + group * (c + 1)]
            np.testing.assert_array_equal(first_block[at : at + group], values)


def test_kernels_use_vector_instructions():
    """The compiled matmul really holds the SIMD dot product (vpdpbusd, else vpmaddubsw).
    Numba shows no assembly for cached code, so compile an uncached copy."""
    import numba

    from fastrun.backends.cpu import matmul, simd
    from fastrun.backends.cpu.activations import quantize_rows

    kernel = numba.njit(parallel=True, fastmath=True)(matmul.matmul_q_many.py_func)
    raw = random_blocks("Q4_K", 8, 256, np.random.default_rng(0))
    tiles = get_backend("cpu").load_weight(raw, "Q4_K", 8, 256).kernel_bytes
    xq, xd, xs, isum = quantize_rows(np.ones((1, 256), np.float32), "Q8_K")
    fmts = np.full(matmul.MANY, matmul.FORMATS.index("Q4_K"), np.int64)
    ws = (tiles, tiles[:0], tiles[:0])
    outs = tuple(np.empty((1, cols), np.float32) for cols in (8, 0, 0))
    kernel(matmul.format_set(["Q4_K"]), ws, fmts, xq, xd, xs, isum, outs, 256)
    asm = "".join(kernel.inspect_asm().values())
    if simd.HAS_VNNI:  # the integer dot products in vpdpbusd (AVX-512 VNNI or AVX-VNNI)
        assert "vpdpbusd" in asm and "vcvtph2ps" in asm
    elif simd.HAS_AVX2:
        assert "vpmaddubsw" in asm and "vpmaddwd" in asm and "vcvtph2ps" in asm


def test_results_do_not_depend_on_thread_count(tiny_model):
    import numba

    from fastrun.runner.api import Model

    m = Model(tiny_model, n_ctx=64)
    ids = list(range(3, 40))
    runs = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        runs.append(m.transformer.forward(ids, m.transformer.new_cache(64), all_logits=True))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "F16"])
@pytest.mark.parametrize("n", [1, 5, 20])
def test_fused_products(backend, qtype, n):
    """norm_matmul_many, matmul_add and silu_mul_matmul_add against their compositions."""
    rng = np.random.default_rng(seed_of(qtype, n, "fused"))
    n_out, n_in = 64, 512
    raws = [random_blocks(qtype, n_out, n_in, rng) for _ in range(2)]
    x, up, res = rng.standard_normal((3, n, n_in)).astype(np.float32)
    res = res[:, :n_out].copy()
    norm = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    ws_ref = [ref.load_weight(r, qtype, n_out, n_in) for r in raws]
    ws = [backend.load_weight(r, qtype, n_out, n_in) for r in raws]

    def close(got, expect):
        np.testing.assert_allclose(
            host(backend, got), expect, rtol=1e-4, atol=1e-4 * np.abs(expect).max()
        )

    normed = ref.rms_norm(x, norm, 1e-5)
    got = backend.norm_matmul_many(dev(backend, x), backend.load_vector(norm), 1e-5, ws)
    for g, w in zip(got, ws_ref, strict=True):
        close(g, ref.matmul(normed, w))
    got = backend.matmul_add(dev(backend, x), ws[0], dev(backend, res))
    close(got, res + ref.matmul(x, ws_ref[0]))
    gate_up = np.concatenate([x, up], axis=1)  # gate and up as views of one product
    g_dev = dev(backend, gate_up)
    got = backend.silu_mul_matmul_add(g_dev[:, :n_in], g_dev[:, n_in:], ws[1], dev(backend, res))
    close(got, res + ref.matmul(ref.silu_mul(x, up), ws_ref[1]))


@pytest.mark.parametrize("neox", [False, True])
def test_attention_inputs(backend, neox):
    rng = np.random.default_rng(12)
    n, h, hk, hd, c = 3, 4, 2, 64, 16
    q, k, v = (rng.standard_normal((n, m * hd)).astype(np.float32) for m in (h, hk, hk))
    biases = [rng.standard_normal(a.shape[1]).astype(np.float32) for a in (q, k, v)]
    pos, slots = np.array([4, 5, 6], np.int32), np.array([9, 10, 11], np.int32)
    cfg = RopeConfig(n_dims=32, freq_base=1e4, neox=neox)  # partial rotation: dims 32.. kept
    k_ref, v_ref = ref.zeros((c, hk, hd)), ref.zeros((c, hk, hd))
    expect = ref.attention_inputs(
        q.copy(), k.copy(), v.copy(), biases, k_ref, v_ref, pos, slots, cfg
    )
    k_dev, v_dev = backend.zeros((c, hk, hd)), backend.zeros((c, hk, hd))
    got = backend.attention_inputs(
        dev(backend, q),
        dev(backend, k),
        dev(backend, v),
        [backend.load_vector(b) for b in biases],
        k_dev,
        v_dev,
        pos,
        slots,
        cfg,
    )
    np.testing.assert_allclose(host(backend, got), expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host(backend, k_dev), k_ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(host(backend, v_dev), v_ref)


@pytest.mark.parametrize(
    "kind, neox",
    [("decode", False), ("decode", True), ("check", False), ("few", True), ("few", False),
     ("ring", False), ("ring decode", True)],
)  # fmt: skip
def test_rope_attention(backend, kind, neox):
    """One layer's attention from its projections gives the bits of attention_inputs then
    attention, in the output and in the cache, and the reference's numbers. decode: three
    sequences' next tokens (CUDA: attn_split rotating the queries and storing the new rows
    itself); check and few: three and nine tokens of one sequence (rope_kv, then attn_split
    or attn_few); ring: a sliding-window layer's ring of 32 rows a sequence, wrapping."""
    from fastrun.backends.base import Backend

    rng = np.random.default_rng(seed_of(kind, neox))
    hk, h, hd, rows = 2, 4, 64, 120  # 40 rows a sequence, or a ring of 32
    ring, window = (32, 20) if kind.startswith("ring") else (0, 0)
    if kind in ("decode", "ring decode"):
        seq, pos = np.array([0, 1, 2]), np.array([7, 39, 0])
    else:
        n = {"check": 3, "few": 9, "ring": 6}[kind]
        seq, pos = np.zeros(n, np.int64), np.arange(28, 28 + n)
    pos = pos.astype(np.int32)
    offsets = np.array([7, 30, 1])[seq].astype(np.int32)
    starts = (seq * (ring or 40)).astype(np.int32)
    slots = starts + ((pos + offsets) % ring if ring else pos)
    n = len(pos)
    q, k, v = (rng.standard_normal((n, m * hd)).astype(np.float32) for m in (h, hk, hk))
    biases = [rng.standard_normal(a.shape[1]).astype(np.float32) for a in (q, k, v)]
    cfg = RopeConfig(n_dims=32, freq_base=1e4, neox=neox)  # partial rotation: dims 32.. kept
    reads = (hd**-0.5, starts, window, 0.0, ring, offsets if ring else None, len(set(seq)) == 1)
    reads += (len(set(seq)) == len(seq),)  # one_token_each
    cache_seed = seed_of(kind, neox, "cache")
    k_ref, v_ref, _, _ = _random_cache(ref, np.random.default_rng(cache_seed), rows, hk, hd)
    expect = ref.rope_attention(
        q.copy(), k.copy(), v.copy(), biases, cfg, slots, k_ref, v_ref, pos, *reads
    )
    outputs, caches = [], []
    for attend in (backend.rope_attention, partial(Backend.rope_attention, backend)):
        _, _, kc, vc = _random_cache(backend, np.random.default_rng(cache_seed), rows, hk, hd)
        inputs = [dev(backend, a) for a in (q, k, v)]
        bs = [backend.load_vector(b) for b in biases]
        outputs.append(host(backend, attend(*inputs, bs, cfg, slots, kc, vc, pos, *reads)))
        caches.append((host(backend, kc), host(backend, vc)))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    for together, apart in zip(*caches, strict=True):
        np.testing.assert_array_equal(together, apart)
    assert_attention_close(outputs[0], expect, v_ref)
    np.testing.assert_allclose(caches[0][0], k_ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(caches[0][1], v_ref)


def _random_cache(backend, rng, c, hk, hd):
    """Reference and backend caches [c, hk, hd] holding the same random keys and values:
    (k_ref, v_ref, k_dev, v_dev)."""
    kv = rng.standard_normal((2, c, hk, hd)).astype(np.float32)
    k_ref, v_ref = ref.zeros((c, hk, hd)), ref.zeros((c, hk, hd))
    k_dev, v_dev = backend.zeros((c, hk, hd)), backend.zeros((c, hk, hd))
    every = np.arange(c, dtype=np.int32)
    ref.kv_write(k_ref, v_ref, kv[0], kv[1], every)
    backend.kv_write(k_dev, v_dev, dev(backend, kv[0]), dev(backend, kv[1]), every)
    return k_ref, v_ref, k_dev, v_dev


def test_attention_over_sequences_of_one_cache(backend):
    """Queries of several sequences, each attending to its own rows (starts) of one cache."""
    rng = np.random.default_rng(13)
    hk, hd, c, h = 2, 64, 3 * 300, 6
    k_ref, v_ref, k_dev, v_dev = _random_cache(backend, rng, c, hk, hd)
    q = rng.standard_normal((3, h, hd)).astype(np.float32)
    pos, starts = np.array([7, 299, 0], np.int32), np.array([0, 300, 600], np.int32)
    expect = ref.attention(q, k_ref, v_ref, pos, 0.125, starts)
    got = backend.attention(dev(backend, q), k_dev, v_dev, pos, 0.125, starts)
    assert_attention_close(host(backend, got), expect, v_ref)


@pytest.mark.parametrize("hd", [64, 128, 256])
def test_attention_of_a_prefill_sized_batch(backend, hd):
    """Many queries at once (CUDA: tiles of one sequence's consecutive positions): a long run
    of one sequence, a lone decode token of another, a run of a third from position 0."""
    rng = np.random.default_rng(14)
    hk, c, h = 2, 3 * 300, 4
    k_ref, v_ref, k_dev, v_dev = _random_cache(backend, rng, c, hk, hd)
    pos = np.concatenate([np.arange(10, 160), [299], np.arange(0, 49)]).astype(np.int32)
    starts = np.repeat(np.array([0, 300, 600], np.int32), [150, 1, 49])
    q = rng.standard_normal((len(pos), h, hd)).astype(np.float32)
    scale = hd**-0.5
    expect = ref.attention(q, k_ref, v_ref, pos, scale, starts)
    got = backend.attention(dev(backend, q), k_dev, v_dev, pos, scale, starts)
    assert_attention_close(host(backend, got), expect, v_ref)


@pytest.mark.parametrize("hd, window, ring", [(64, 0, 0), (96, 0, 0), (64, 20, 32)])
def test_each_token_attends_alone_as_in_a_batch(hd, window, ring):
    """CPU batch invariance of attention: a prefill-sized batch shares each key row among
    the query heads of a KV head (ops.attention), a lone token does not; the bits are the
    same. hd 96: the value sums' portable loop; a ring: its rows visited in two runs."""
    cpu = get_backend("cpu")
    rng = np.random.default_rng(21)
    hk, h, n = 2, 6, 40
    rows = ring if ring else 64
    k = rng.standard_normal((rows, hk, hd)).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((rows, hk, hd)).astype(np.float16).astype(np.float32)
    q = rng.standard_normal((n, h, hd)).astype(np.float32)
    pos = np.arange(10, 10 + n, dtype=np.int32)
    offsets = np.full(n, 7 if ring else 0, np.int32)
    args = (hd**-0.5, None, window, 0.0, ring)
    together = cpu.attention(q, k, v, pos, *args, offsets)
    for i in range(n):
        alone = cpu.attention(q[i : i + 1], k, v, pos[i : i + 1], *args, offsets[i : i + 1])
        np.testing.assert_array_equal(alone[0], together[i])


def _filled_cache(backend, rng, layers, rows, hk, hd):
    """Reference and backend caches [layers, rows, hk, hd] holding the same random values."""
    ref_kv = (ref.zeros((layers, rows, hk, hd)), ref.zeros((layers, rows, hk, hd)))
    dev_kv = (backend.zeros((layers, rows, hk, hd)), backend.zeros((layers, rows, hk, hd)))
    every = np.arange(rows, dtype=np.int32)
    for layer in range(layers):
        k, v = rng.standard_normal((2, rows, hk, hd)).astype(np.float32)
        ref.kv_write(ref_kv[0][layer], ref_kv[1][layer], k, v, every)
        backend.kv_write(
            dev_kv[0][layer], dev_kv[1][layer], dev(backend, k), dev(backend, v), every
        )
    return ref_kv, dev_kv


@pytest.mark.parametrize(
    "src, dst, n, shift", [(10, 40, 20, 0), (20, 4, 30, -16), (4, 4, 8, 0), (30, 2, 7, -28)]
)
@pytest.mark.parametrize("neox", [False, True])
def test_kv_copy(backend, src, dst, n, shift, neox):
    """Cache rows copied across every layer, keys re-rotated by a shift (context shift), the
    ranges overlapping or not; a key rotated to position p, then shifted by s, is the key
    rotated to p + s."""
    rng = np.random.default_rng(seed_of(src, dst, n, shift, neox))
    layers, rows, hk, hd = 3, 64, 2, 64
    cfg = RopeConfig(n_dims=hd, freq_base=1e4, neox=neox)
    (k_ref, v_ref), (k_dev, v_dev) = _filled_cache(backend, rng, layers, rows, hk, hd)
    ref.kv_copy(k_ref, v_ref, src, dst, n, shift, cfg)
    backend.kv_copy(k_dev, v_dev, src, dst, n, shift, cfg)
    np.testing.assert_allclose(host(backend, k_dev), k_ref, rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(host(backend, v_dev), v_ref)
    if shift:  # the composition of rotations, against rotating once
        x = rng.standard_normal((n, hk, hd)).astype(np.float32)
        pos = np.arange(100, 100 + n, dtype=np.int32)
        once = ref.rope(x.copy(), pos + shift, cfg)
        k, v = (ref.zeros((1, rows, hk, hd)) for _ in range(2))
        ref.kv_write(k[0], v[0], ref.rope(x.copy(), pos, cfg), x, np.arange(src, src + n))
        ref.kv_copy(k, v, src, dst, n, shift, cfg)
        np.testing.assert_allclose(k[0, dst : dst + n], once, rtol=0, atol=4e-3)


def test_gather_rows(backend):
    x = np.random.default_rng(14).standard_normal((9, 40)).astype(np.float32)
    rows = np.array([8, 0, 3], np.int32)
    np.testing.assert_array_equal(
        host(backend, backend.gather_rows(dev(backend, x), rows)), x[rows]
    )


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_matmul_many_tokens(backend, qtype):
    """Prefill-sized batches: a backend may take another path there (CUDA: fp16 weights and
    activations through cuBLAS), so the check is against the exact product, at the error of
    8-bit activations."""
    rng = np.random.default_rng(seed_of(qtype, "rows"))
    n, n_out, n_in = 150, 40, 512
    raw = random_blocks(qtype, n_out, n_in, rng)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    w = ref.load_weight(raw, qtype, n_out, n_in)
    exact = x.astype(np.float64) @ w.dense.T.astype(np.float64)
    got = host(
        backend, backend.matmul(dev(backend, x), backend.load_weight(raw, qtype, n_out, n_in))
    )
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-2 * np.abs(exact).max())


@pytest.mark.parametrize("k", [1, 3, 40, 64])
@pytest.mark.parametrize("vocab", [300, 49152, 152064])
def test_top_k(backend, k, vocab):
    rng = np.random.default_rng(seed_of(k, vocab))
    x = rng.standard_normal((3, vocab)).astype(np.float32)
    x[1, rng.integers(0, vocab, 80)] = 9.0  # ties at the top: the lower ids come first
    x[2, :50] = np.nan  # NaN never wins
    x[2, 60] = np.inf
    ids, values = (host(backend, a) for a in backend.top_k(dev(backend, x), k))
    expect_ids, expect_values = ref.top_k(x, k)
    np.testing.assert_array_equal(ids, expect_ids)
    np.testing.assert_array_equal(values, expect_values)
    assert ids[1, 0] == np.flatnonzero(x[1] == 9.0)[0]
    largest = -np.sort(-np.nan_to_num(x, nan=-np.inf, posinf=np.inf), axis=1)[:, :k]
    np.testing.assert_array_equal(expect_values, largest)


def test_gelu_mul_scale_softcap(backend):
    """The gemma steps: GELU (tanh) gating with llama.cpp's fp16 table (and its cut-offs at
    +-10), a scale, a tanh soft-cap."""
    rng = np.random.default_rng(15)
    g, u = rng.standard_normal((2, 4, 300)).astype(np.float32) * 5
    g[0, :4] = [-10.5, -10.0, 10.0, 12.0]
    got = host(backend, backend.gelu_mul(dev(backend, g), dev(backend, u)))
    expect = ref.gelu_mul(g, u)
    # a tanh in other precision may flip an fp16 rounding: one fp16 step at most
    np.testing.assert_allclose(got, expect, rtol=1e-3, atol=1e-6)
    got = host(backend, backend.scale(dev(backend, g), 25.3))
    np.testing.assert_allclose(got, ref.scale(g.copy(), 25.3), rtol=1e-6)
    got = host(backend, backend.softcap(dev(backend, g), 3.0))
    np.testing.assert_allclose(got, ref.softcap(g.copy(), 3.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window, softcap", [(8, 0.0), (0, 5.0), (40, 2.0)])
@pytest.mark.parametrize("n", [1, 3, 150])
def test_attention_window_and_softcap(backend, window, softcap, n):
    """Sliding-window layers see only their last `window` positions; soft-capped scores.
    Decode-sized and prefill-sized batches (CUDA: the split and the tiled kernels)."""
    rng = np.random.default_rng(seed_of(window, softcap, n))
    hk, hd, c, h = 1, 64, 400, 4
    k_ref, v_ref, k_dev, v_dev = _random_cache(backend, rng, c, hk, hd)
    pos = np.arange(200 - n, 200, dtype=np.int32) if n > 1 else np.array([350], np.int32)
    starts = np.zeros(n, np.int32)
    q = rng.standard_normal((n, h, hd)).astype(np.float32)
    args = (pos, 0.5, starts, window, softcap)
    expect = ref.attention(q, k_ref, v_ref, *args)
    got = backend.attention(dev(backend, q), k_dev, v_dev, *args)
    assert_attention_close(host(backend, got), expect, v_ref)


def _ring_of(full, lengths, offsets, full_rows: int, ring: int, backend=None):
    """The rings [3 * ring + 1, hk, hd] that hold, for each sequence s of a full-context
    cache (full_rows rows each), its last `ring` positions before lengths[s], position p at
    row s * ring + (p + offsets[s]) % ring: the layout of runner/kv_cache.py."""
    out = (backend or ref).zeros((len(lengths) * ring + 1, *full.shape[1:]))
    for s, (length, offset) in enumerate(zip(lengths, offsets, strict=True)):
        positions = np.arange(max(0, length - ring), length)
        rows = s * ring + (positions + offset) % ring
        values = full[s * full_rows + positions]
        if backend is None:
            out[rows] = values
        else:  # the same fp16 values through the backend's own write
            backend.kv_write(out, out, dev(backend, values), dev(backend, values), rows)
    return out


@pytest.mark.parametrize("hd", [64, 256])
@pytest.mark.parametrize("n, window", [(1, 40), (3, 40), (150, 40), (150, 7), (3, 95)])
def test_attention_through_a_ring(backend, n, window, hd):
    """A sliding-window layer's ring (kv_cache.py): each query reads its last `window`
    positions at rows start + (p + offset) % ring, wrapping once where its window crosses
    the ring's end. The reference against itself over full rows (the ring is only a layout),
    then each backend against the reference, decode-sized and prefill-sized (CUDA: the split
    and the tiled kernels; 150 queries of three sequences, tiles past a wrap)."""
    rng = np.random.default_rng(seed_of(n, window, hd, "ring"))
    hk, h, full_rows, ring = 2, 4, 300, 96
    lengths = np.array([300, 171, 60])
    offsets = np.array([37, 90, 5])  # sequence 0's windows and tiles wrap, 1's decode too
    kv = [rng.standard_normal((3 * full_rows, hk, hd)).astype(np.float32) for _ in range(2)]
    full = [ref.zeros(a.shape) for a in kv]
    ref.kv_write(*full, *kv, np.arange(3 * full_rows, dtype=np.int32))
    rings = [_ring_of(a, lengths, offsets, full_rows, ring) for a in full]
    per_seq = [n // 3 + (s < n % 3) for s in range(3)]  # queries: each sequence's last ones
    seq = np.repeat(np.arange(3), per_seq)
    pos = np.concatenate([np.arange(lengths[s] - m, lengths[s]) for s, m in enumerate(per_seq)])
    pos = pos.astype(np.int32)
    q = rng.standard_normal((n, h, hd)).astype(np.float32)
    scale = hd**-0.5
    ring_args = (window, 0.0, ring, offsets[seq].astype(np.int32))
    expect = ref.attention(q, *rings, pos, scale, (seq * ring).astype(np.int32), *ring_args)
    over_full = ref.attention(q, *full, pos, scale, (seq * full_rows).astype(np.int32), window)
    np.testing.assert_array_equal(expect, over_full)
    k_dev = _ring_of(full[0], lengths, offsets, full_rows, ring, backend)
    v_dev = _ring_of(full[1], lengths, offsets, full_rows, ring, backend)
    got = backend.attention(
        dev(backend, q), k_dev, v_dev, pos, scale, (seq * ring).astype(np.int32), *ring_args
    )
    assert_attention_close(host(backend, got), expect, full[1])


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize(
    "n, last, window, softcap, ring",
    [(5, 200, 0, 0.0, 0), (9, 520, 0, 0.0, 0), (16, 40, 0, 3.0, 0), (7, 7, 0, 0.0, 0),
     (9, 300, 40, 0.0, 0), (12, 300, 40, 0.0, 96)],
)  # fmt: skip
def test_attention_of_one_sequence(backend, n, last, window, softcap, ring, hd):
    """A checking pass: n queries of one sequence at its last positions (.. last - 1), told
    to the backend (one_sequence; CUDA: attn_few, one block a head and split for all of them,
    from 5 queries), over long and short spans, a window, softcap, a ring past its wrap, and
    queries sharing KV heads; CUDA also with the positions on the device, as in a graph."""
    rng = np.random.default_rng(seed_of(n, last, window, softcap, ring, hd, "one"))
    hk, h, start = 2, 6, 100
    c = start + 600
    k_ref, v_ref, k_dev, v_dev = _random_cache(backend, rng, c, hk, hd)
    pos = np.arange(last - n, last, dtype=np.int32)
    offsets = np.full(n, 37, np.int32)
    if ring:  # the sequence's last `ring` positions on its ring rows, start + (p + 37) % ring
        seen = np.arange(last - ring, last)
        rows = (start + (seen + 37) % ring).astype(np.int32)
        k_ref[rows], v_ref[rows] = k_ref[start + seen].copy(), v_ref[start + seen].copy()
        backend.kv_move(k_dev[None], v_dev[None], start + seen, rows)
    starts = np.full(n, start, np.int32)
    q = rng.standard_normal((n, h, hd)).astype(np.float32)
    args = (hd**-0.5, starts, window, softcap, ring, offsets if ring else None)
    expect = ref.attention(q, k_ref, v_ref, pos, *args)
    got = backend.attention(dev(backend, q), k_dev, v_dev, pos, *args, one_sequence=True)
    assert_attention_close(host(backend, got), expect, v_ref)
    if type(k_dev).__module__.startswith("cupy"):  # the graph's int vectors on the device
        import cupy as cp

        on_device = (cp.asarray(pos), hd**-0.5, cp.asarray(starts), window, softcap, ring)
        on_device += (cp.asarray(offsets) if ring else None,)
        got = backend.attention(dev(backend, q), k_dev, v_dev, *on_device, one_sequence=True)
        assert_attention_close(host(backend, got), expect, v_ref)


def test_kv_move(backend):
    """Rows moved across every layer, every one read before any is written (a context
    shift's kept tokens within a ring: sources and destinations may overlap)."""
    rng = np.random.default_rng(16)
    layers, rows, hk, hd = 3, 40, 2, 64
    (k_ref, v_ref), (k_dev, v_dev) = _filled_cache(backend, rng, layers, rows, hk, hd)
    src, dst = np.array([3, 4, 5, 6, 39]), np.array([5, 6, 7, 8, 0])
    before = k_ref.copy()
    ref.kv_move(k_ref, v_ref, src, dst)
    np.testing.assert_array_equal(k_ref[:, dst], before[:, src])
    backend.kv_move(k_dev, v_dev, src, dst)
    np.testing.assert_array_equal(host(backend, k_dev), k_ref)
    np.testing.assert_array_equal(host(backend, v_dev), v_ref)


def test_products_compiled_for_several_formats():
    """A product compiled for a set of formats (a model's: matmul.format_set) gives each
    weight the bits its own single-format kernel gives, whichever activation format."""
    from fastrun.backends.cpu import matmul

    cpu = get_backend("cpu")
    names = ["Q4_1", "Q8_0", "Q6_K"]
    several = matmul.format_set(names)
    x = np.random.default_rng(7).standard_normal((5, 512)).astype(np.float32)
    for name in names:
        raw = random_blocks(name, 16, 512, np.random.default_rng(seed_of(name, "set")))
        w = cpu.load_weight(raw, name, 16, 512)
        args = (w.kernel, w.format.block_size, w.format.activation == "Q8_K")
        alone = matmul.qmatmul(w.formats, w.kernel_bytes, x, *args)
        np.testing.assert_array_equal(matmul.qmatmul(several, w.kernel_bytes, x, *args), alone)
