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
