"""Sliding-window layers keep a ring of cells per sequence (runner/kv_cache.py): the same
tokens and logits as full-context storage (the same arithmetic in the same order), through
passes of every size a ring admits, context shifts, speculative trims and prefix reuse; and
a cache that does not grow with the context. A tiny Gemma-3-shaped model: five local layers
of an 8-position window to one global; passes of at most 16 tokens, so rings of 24 rows."""

import numpy as np
import pytest
from helpers import greedy_steps, write_tiny_model

from fastrun.backends import get_backend
from fastrun.formats import GGUFFile
from fastrun.formats.errors import FastrunError
from fastrun.runner import kv_cache
from fastrun.runner.api import Model
from fastrun.runner.models import model_class
from fastrun.runner.validate import kv_cache_bytes

WINDOW, PASS = 8, 16
RING = WINDOW + PASS  # rows of a sequence's ring


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma")
    return write_tiny_model(
        folder / "tiny-gemma3.gguf", arch="gemma3", qtype="Q8_0", n_embd=128, n_ff=256,
        n_layer=6, window=WINDOW,
    )  # fmt: skip


@pytest.fixture
def full_storage(monkeypatch):
    """Cells made inside keep every layer's full context (the comparison's result)."""
    monkeypatch.setattr(kv_cache, "ring_rows", lambda *args: 0)


def _transformer(path, backend="cpu"):
    f = GGUFFile(str(path))
    return model_class(f.architecture)(f, get_backend(backend))


def _teacher_forced(tf, cache, ids, sizes):
    """Logits of every id, run in passes of the given sizes in turn."""
    out, at, turn = [], 0, 0
    while at < len(ids):
        n = sizes[turn % len(sizes)]
        out.append(tf.forward(ids[at : at + n], cache, all_logits=True))
        at, turn = at + n, turn + 1
    return np.concatenate(out)


def test_sliding_layers_cache_does_not_grow_with_the_context(gemma_path):
    tf = _transformer(gemma_path)
    small, large = tf.new_cells(2, 1024, PASS), tf.new_cells(2, 4096, PASS)
    assert small.ring == large.ring == RING
    assert small.ring_k.shape == large.ring_k.shape == (5, 2 * RING + 1, 2, 32)
    assert small.k.shape == (1, 2 * 1024 + 1, 2, 32) and large.k.shape == (1, 2 * 4096 + 1, 2, 32)
    per_row = 2 * 2 * 32 * 4  # keys and values of a row, float32
    for n_ctx, cells in ((1024, small), (4096, large)):
        assert cells.nbytes == per_row * (2 * n_ctx + 1 + 5 * (2 * RING + 1))
        assert kv_cache_bytes(n_ctx, tf.config, tf.backend, 2, PASS) == cells.nbytes
    short = tf.new_cells(1, RING, PASS)  # no smaller than a ring: full rows, as before
    assert short.ring == 0 and short.k.shape[0] == 6 and short.ring_k.shape[0] == 0


@pytest.mark.parametrize("backend, qtype", [("cpu", "Q8_0"), ("cpu", "F32"), ("reference", "Q8_0")])
def test_ring_logits_equal_full_storage(gemma_path, tmp_path, backend, qtype):
    """Teacher-forced logits over 10 windows, passes of 1 to 16 tokens (the ring wraps inside
    windows and inside passes): the CPU's compiled stack (Q8_0), its layer-by-layer path
    (F32 weights) and the NumPy reference."""
    path = gemma_path
    if qtype == "F32":
        path = write_tiny_model(
            tmp_path / "f32.gguf", arch="gemma3", qtype="F32", n_embd=128, n_ff=256, n_layer=6
        )
    tf = _transformer(path, backend)
    assert (tf._stack is not None) == (backend == "cpu" and qtype == "Q8_0")
    ids = np.random.default_rng(1).integers(0, 296, 80 if backend == "reference" else 160)
    sizes = [5, 16, 1, 1, 3, 11, 1, 16]
    ring = tf.new_cache(256, PASS)
    assert ring.cells.ring == RING
    got = _teacher_forced(tf, ring, ids.tolist(), sizes)
    expect = _teacher_forced(tf, tf.new_cache(256), ids.tolist(), sizes)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize(
    "keep, discard", [(4, 30), (4, 10), (0, 5), (30, 9), (12, 1), (40, 5), (44, 3)]
)
def test_context_shift_on_a_ring(gemma_path, keep, discard):
    """After a shift of any size the ring still holds (offset moved, moved keys re-rotated
    in place, kept tokens relocated where still visible: (40, 5), (44, 3)) the logits of
    full storage: over 50 tokens, then 40 more past it."""
    tf = _transformer(gemma_path)
    ids = np.random.default_rng(2).integers(0, 296, 90).tolist()
    ring, full = tf.new_cache(128, PASS), tf.new_cache(128)
    for cache in (ring, full):
        _teacher_forced(tf, cache, ids[:50], [16, 9, 1])
        cache.shift(keep, discard, tf.layer_ropes(cache.cells))
    assert ring.tokens == full.tokens == ids[:keep] + ids[keep + discard : 50]
    got = _teacher_forced(tf, ring, ids[50:], [1, 16, 3])
    expect = _teacher_forced(tf, full, ids[50:], [1, 16, 3])
    np.testing.assert_array_equal(got, expect)


def test_a_shift_that_leaves_the_window_without_its_cells_is_refused(gemma_path):
    """Dropping more than the ring's spare rows while the kept tokens stay visible: those
    were overwritten, and the next pass says so instead of reading other tokens' cells (the
    engine's shifts move as many tokens as they drop and never get here)."""
    tf = _transformer(gemma_path)
    cache = tf.new_cache(128, PASS)
    tf.forward(list(range(40)), cache)
    # 4 kept, 4 moved: the kept ones were overwritten
    cache.shift(4, 32, tf.layer_ropes(cache.cells))
    with pytest.raises(FastrunError, match="overwritten"):
        tf.forward([7], cache)


def test_a_pass_larger_than_the_rings_admit_is_refused(gemma_path):
    from fastrun.runner.batch import Batch

    tf = _transformer(gemma_path)
    cache = tf.new_cache(128, PASS)
    batch = Batch()
    batch.add(cache, list(range(10)))
    with pytest.raises(FastrunError, match="take 16"):
        batch.add(cache, list(range(7)))
    assert cache.length == 10


def test_greedy_chains_on_rings_are_single_steps(gemma_path):
    """Transformer.run_chain across the rings' wrap (30 steps past a 20-token prompt, rings of
    24 rows): the picks, tokens and every cell of single top-1 steps, bit for bit."""
    tf = _transformer(gemma_path)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 296, 20).tolist(), rng.integers(0, 296, 9).tolist()]
    results = []
    for chained in (False, True):
        cells = tf.new_cells(2, 128, PASS)
        for seq, prompt in zip(cells.sequences, prompts, strict=True):
            tf.forward(prompt, seq)
        picks = greedy_steps(tf, cells, [3, 4], [8, 8, 8, 6], chained)
        stores = [cells.k, cells.v, cells.ring_k, cells.ring_v]
        results.append((picks, [s.tokens for s in cells.sequences], *map(np.array, stores)))
    assert cells.ring == RING
    single, chain = results
    assert chain[:2] == single[:2]
    for a, b in zip(chain[2:], single[2:], strict=True):
        np.testing.assert_array_equal(a, b)


def _completions(path, prompts, **settings):
    sampling = settings.pop("sampling")
    m = Model(path, backend="cpu", parallel=len(prompts), batch_size=PASS, **settings)
    streams = [m.generate(p, **sampling) for p in prompts]
    out = []
    for s in streams:
        for _ in s:
            pass
        out.append((s.completion.tokens, s.completion.context_shifts))
    rings = m.engine.cells.ring
    m.close()
    return out, rings


SAMPLED = dict(max_tokens=150, temperature=1.0, seed=3, ignore_eos=True)
SHIFTS = [(dict(n_ctx=200), 0), (dict(n_ctx=60), 3), (dict(n_ctx=40, n_keep=-1), 3)]


@pytest.mark.parametrize("settings, shifts", SHIFTS)
def test_engine_generation_on_rings_equals_full_storage(gemma_path, monkeypatch, settings, shifts):
    """Two sequences sampled 150 tokens (18 windows) through the engine, prompts prefilled in
    passes of 16; with context shifts (n_keep=-1 keeps the 28-token prompt: the kept tokens
    stay inside the window after each shift, whose few rows then move in the ring)."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 296, 28).tolist(), rng.integers(0, 296, 5).tolist()]
    got, rings = _completions(gemma_path, prompts, sampling=SAMPLED, **settings)
    assert rings == RING
    monkeypatch.setattr(kv_cache, "ring_rows", lambda *args: 0)
    expect, rings = _completions(gemma_path, prompts, sampling=SAMPLED, **settings)
    assert rings == 0
    assert got == expect
    assert all(n >= shifts for _, n in got) and len(set(got[0][0])) > 20


@pytest.mark.parametrize("kind", ["lookup", "self"])
def test_speculation_on_rings_equals_plain_full_storage(gemma_path, monkeypatch, kind):
    """Drafts checked and rejected ones trimmed on the target's rings (and, drafting for
    itself, on the draft's own, which mirror its shifts): greedy tokens as plain decoding."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 296, 20).tolist(), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    greedy = dict(max_tokens=120, temperature=0, ignore_eos=True, frequency_penalty=0.5)
    spec = dict(lookup=True) if kind == "lookup" else dict(draft=str(gemma_path))
    got, rings = _completions(gemma_path, prompts, sampling=greedy, n_ctx=64, **spec)
    assert rings == RING
    monkeypatch.setattr(kv_cache, "ring_rows", lambda *args: 0)
    expect, _ = _completions(gemma_path, prompts, sampling=greedy, n_ctx=64)
    assert got == expect and len(set(got[0][0])) > 20


def test_prefix_reuse_on_rings(gemma_path, monkeypatch):
    """A new turn continuing a long sequence reuses it (its last window is in the ring); a
    prompt sharing only an early prefix runs whole on rings (those cells were overwritten)
    and from the prefix on full storage; every answer as a fresh run's."""
    rng = np.random.default_rng(6)
    first = rng.integers(0, 296, 20).tolist()
    sampling = dict(max_tokens=60, temperature=1.0, seed=7, ignore_eos=True)

    def run():
        m = Model(gemma_path, backend="cpu", n_ctx=256, parallel=1, batch_size=PASS)
        out = m.complete(first, **sampling)
        turn = first + out.tokens + [9, 10]
        early = first[:10] + [11, 12, 13]
        done = [m.complete(p, **sampling) for p in (turn, early)]
        m.close()
        return turn, early, [(d.tokens, d.prefilled_tokens) for d in done]

    turn, early, got = run()
    assert [p for _, p in got] == [3, len(early)]
    monkeypatch.setattr(kv_cache, "ring_rows", lambda *args: 0)
    _, _, expect = run()
    assert [p for _, p in expect] == [3, 3]
    assert [t for t, _ in got] == [t for t, _ in expect]


@pytest.mark.slow
def test_real_gemma3_on_rings_equals_full_storage(monkeypatch):
    """Gemma 3 270M (window 512; rings of 1,024 rows) past two rings: teacher-forced
    log-probabilities of 2,500 tokens and a greedy continuation of 1,200 tokens, bit for bit
    those of full storage on the CPU."""
    from helpers import real_model

    path = real_model("gemma3-270m")
    text = open("/usr/share/common-licenses/GPL-3").read()

    def run():
        m = Model(path, backend="cpu", n_ctx=4096, parallel=1)
        tokens = m.tokenize(text, add_bos=True)[:2500]
        logprobs = m.logprobs(tokens)
        greedy = m.complete(tokens[:100], max_tokens=1200, temperature=0, ignore_eos=True)
        rings = m.engine.cells.ring
        m.close()
        return logprobs, greedy.tokens, rings

    logprobs, greedy, rings = run()
    assert rings == 1024 and len(greedy) == 1200
    monkeypatch.setattr(kv_cache, "ring_rows", lambda *args: 0)
    full_logprobs, full_greedy, rings = run()
    assert rings == 0
    np.testing.assert_array_equal(logprobs, full_logprobs)
    assert greedy == full_greedy
