"""The engine: parallel sequences in shared passes, context shift, prefix reuse, cancellation,
the bounded queue, and batch invariance (a sequence's tokens do not depend on its neighbours)."""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import greedy_steps, write_tiny_model

from fastrun.backends import get_backend
from fastrun.formats import GGUFFile
from fastrun.runner.api import Model
from fastrun.runner.batch import Batch
from fastrun.runner.engine import QueueFull
from fastrun.runner.generate import log_softmax
from fastrun.runner.models import model_class

LONG = dict(max_tokens=1000, temperature=0, ignore_eos=True)


def _prompts(rng, count, longest=40):
    return [rng.integers(0, 296, rng.integers(1, longest)).tolist() for _ in range(count)]


def _settings(i: int) -> dict:
    """Samplers of every kind: greedy, top-k candidates, whole rows (penalties)."""
    kinds = [
        dict(temperature=0),
        dict(temperature=0.9, top_k=40),
        dict(temperature=0.7, top_k=40, repeat_penalty=1.2),
        dict(temperature=1.0, top_k=0, top_p=0.9),
    ]
    return dict(max_tokens=20, ignore_eos=True, seed=i, **kinds[i % len(kinds)])


def _wait_idle(m: Model, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        stats = m.stats()
        if stats["active"] == 0 and stats["queued"] == 0:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {m.stats()}")


def test_sixteen_sequences_joining_at_random_steps_equal_their_solo_runs(tiny_model):
    rng = np.random.default_rng(0)
    prompts = _prompts(rng, 16)
    solo_model = Model(tiny_model, backend="cpu", n_ctx=96, parallel=1)
    solo = [solo_model.complete(p, **_settings(i)).tokens for i, p in enumerate(prompts)]
    solo_model.close()
    # batch_size 24: long prompts are prefilled in chunks beside the decoding sequences
    m = Model(tiny_model, backend="cpu", n_ctx=96, parallel=16, batch_size=24)
    streams = []
    for i, p in enumerate(prompts):
        streams.append(m.generate(p, **_settings(i)))
        for _ in range(rng.integers(0, 4)):  # let the engine run a few steps first
            next(streams[rng.integers(0, len(streams))], None)
    for s in streams:
        for _ in s:
            pass
    together = [s.completion.tokens for s in streams]
    assert m.engine.steps < sum(len(t) for t in together)  # sequences shared passes
    m.close()
    assert together == solo


def test_logits_alone_and_in_a_batch_are_bit_identical(tiny_model):
    """CPU batch invariance: a sequence's logits do not change with 15 neighbours, some of
    them prefilling in the same pass."""
    with GGUFFile(str(tiny_model)) as f:
        tf = model_class(f.architecture)(f, get_backend("cpu"))
        rng = np.random.default_rng(1)
        prompts = _prompts(rng, 16)
        cells = tf.new_cells(16, 64)
        alone = tf.new_cache(64)
        tf.forward(prompts[0], alone)
        expect = tf.forward([7], alone)
        seqs = cells.sequences
        tf.forward(prompts[0], seqs[0])
        for s, p in zip(seqs[1:8], prompts[1:8], strict=True):
            tf.forward(p[:-1], s)
        batch = Batch()
        row = batch.add(seqs[0], [7])
        for s, p in zip(seqs[1:8], prompts[1:8], strict=True):
            batch.add(s, p[-1:])
        for s, p in zip(seqs[8:], prompts[8:], strict=True):
            batch.add(s, p, "all")  # prefills in the same pass
        got = tf.run(batch, cells)
        np.testing.assert_array_equal(got[row], expect[0])


def test_context_shift_matches_a_fresh_prefill_of_the_kept_tokens(tmp_path):
    """After a shift the next-token distribution equals that of the kept tokens prefilled at
    their new positions. One layer: its keys and values depend on the token alone, so the
    shifted cells must equal fresh ones (deeper models also carry the dropped context)."""
    path = write_tiny_model(tmp_path / "one.gguf", n_layer=1, qtype="Q8_0")
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 296, 60).tolist()
    with GGUFFile(str(path)) as f:
        tf = model_class(f.architecture)(f, get_backend("cpu"))
        cache = tf.new_cache(64)
        tf.forward(ids, cache)
        cache.shift(4, 20, tf.config.rope)
        assert cache.tokens == ids[:4] + ids[24:]
        after = log_softmax(tf.forward([7], cache)[0])
        fresh = log_softmax(tf.forward(ids[:4] + ids[24:] + [7], tf.new_cache(64))[0])
        kl = float(np.sum(np.exp(fresh) * (fresh - after)))
        assert kl <= 1e-3, kl


def test_generation_runs_past_the_context_with_shifts(tiny_model):
    m = Model(tiny_model, backend="cpu", n_ctx=32, parallel=1)
    done = m.complete([5, 6, 7], max_tokens=100, temperature=0, ignore_eos=True)
    assert len(done.tokens) == 100 and done.finish_reason == "length"
    assert done.context_shifts >= 3
    stopped = Model(tiny_model, backend="cpu", n_ctx=32, parallel=1, context_shift=False)
    done = stopped.complete([5, 6, 7], max_tokens=100, temperature=0, ignore_eos=True)
    assert done.finish_reason == "length" and len(done.tokens) == 32 - 3 + 1
    assert done.context_shifts == 0


def test_cli_run_past_the_context(tiny_model):
    r = subprocess.run(
        [sys.executable, "-m", "fastrun.runner.cli", "run", str(tiny_model), "hello", "-c", "48",
         "-n", "200", "--temp", "0", "--ignore-eos", "--json", "--backend", "cpu"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["finish_reason"] == "length" and len(result["tokens"]) == 200
    assert result["context_shifts"] >= 4


def test_prefix_reuse_from_a_finished_and_from_a_live_sequence(tiny_model):
    rng = np.random.default_rng(3)
    system = rng.integers(0, 296, 30).tolist()
    first, second = system + [1, 2, 3], system + [4, 5]
    fresh = Model(tiny_model, backend="cpu", n_ctx=96, parallel=1)
    expect = fresh.complete(second, max_tokens=8, temperature=0).tokens
    m = Model(tiny_model, backend="cpu", n_ctx=96, parallel=2)
    assert m.complete(first, max_tokens=4, temperature=0).prefilled_tokens == len(first)
    done = m.complete(second, max_tokens=8, temperature=0)  # the finished sequence's cells
    assert done.prefilled_tokens == 2 and done.tokens == expect
    live = m.generate(first, **LONG)
    next(live)
    done = m.complete(second, max_tokens=8, temperature=0)  # copied from the live sequence
    live.close()
    assert done.prefilled_tokens == 2 and done.tokens == expect


def test_a_prompt_s_last_token_runs_alone_where_the_backend_is_not_batch_invariant(
    tiny_model, monkeypatch
):
    """Backend.batch_invariant False (CUDA's case): the engine runs a prompt's last token in
    a pass of its own, so its logits are a decode step's whether the prompt ran whole or from
    cached cells; the tokens are those of the CPU's usual passes."""
    prompt = np.random.default_rng(4).integers(0, 296, 20).tolist()
    expect = Model(tiny_model, backend="cpu", n_ctx=64, parallel=1).complete(
        prompt, max_tokens=6, temperature=0
    )
    m = Model(tiny_model, backend="cpu", n_ctx=64, parallel=1)
    transformer = m.engine.transformer
    monkeypatch.setattr(transformer.backend, "batch_invariant", False)
    passes = []
    run = transformer.run
    monkeypatch.setattr(
        transformer, "run", lambda batch, *a: passes.append(batch.n) or run(batch, *a)
    )
    whole = m.complete(prompt, max_tokens=6, temperature=0)
    cached = m.complete(prompt, max_tokens=6, temperature=0)
    assert whole.tokens == cached.tokens == expect.tokens
    assert passes[:2] == [19, 1] and cached.prefilled_tokens == 1


def test_cancel_frees_the_sequence_and_the_queue_is_bounded(tiny_model):
    m = Model(tiny_model, backend="cpu", n_ctx=64, parallel=1, max_queue=1)
    running = m.generate([5, 6], **LONG)
    next(running)
    waiting = m.generate([7, 8], max_tokens=3, temperature=0)
    with pytest.raises(QueueFull):
        m.generate([9], max_tokens=3)
    running.close()  # frees the one sequence: the waiting request runs
    assert len(list(waiting)) >= 1 and waiting.completion.finish_reason in ("length", "stop")
    assert running.completion.finish_reason == "cancelled"
    assert _wait_idle(m)["active"] == 0


def test_threads_share_the_engine(tiny_model):
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, 6)
    m = Model(tiny_model, backend="cpu", n_ctx=96, parallel=4)
    expect = [c.tokens for c in m.generate_batch(prompts, max_tokens=12, temperature=0)]
    results = [None] * len(prompts)

    def worker(i):
        results[i] = m.complete(prompts[i], max_tokens=12, temperature=0).tokens

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expect
    assert m.logprobs([5, 6, 7]).shape == (3, m.config.n_vocab)  # on the engine's thread


def test_logprobs_of_generated_tokens(tiny_model):
    m = Model(tiny_model, backend="cpu", n_ctx=64, parallel=1)
    pieces = list(m.generate([5, 6, 7], max_tokens=4, temperature=0, logprobs=3))
    for piece in pieces:
        assert piece.top_logprobs[0][0] == piece.id  # greedy: the best is the one taken
        assert piece.logprob == pytest.approx(piece.top_logprobs[0][1])
        assert len(piece.top_logprobs) == 3 and piece.logprob <= 0


def test_a_pass_that_wants_no_logits_computes_none(tiny_model):
    """Inner prefill chunks stop after the blocks: no output norm, no vocabulary product."""
    with GGUFFile(str(tiny_model)) as f:
        tf = model_class(f.architecture)(f, get_backend("cpu"))
        calls = []
        norm = tf.backend.rms_norm
        tf.backend.rms_norm = lambda *a: calls.append(1) or norm(*a)
        cells = tf.new_cells(2, 64)
        batch = Batch()
        batch.add(cells.sequences[0], [5, 6, 7], "none")
        batch.add(cells.sequences[1], [8, 9], "none")
        assert tf.run(batch, cells) is None and not calls
        assert [s.length for s in cells.sequences] == [3, 2]


def test_a_chain_of_greedy_steps_is_those_steps_one_at_a_time(tiny_model):
    """Transformer.run_chain: each step's pick fed to the next on the backend gives the ids,
    the cells' tokens and their keys and values of run(top_k=1) step by step, bit for bit."""
    with GGUFFile(str(tiny_model)) as f:
        tf = model_class(f.architecture)(f, get_backend("cpu"))
        prompts = _prompts(np.random.default_rng(4), 3)
        results = []
        for chained in (False, True):
            cells = tf.new_cells(3, 64)
            for seq, p in zip(cells.sequences, prompts, strict=True):
                tf.forward(p, seq)
            picks = greedy_steps(tf, cells, [7, 8, 9], [5, 1, 3], chained)
            k, v = (tf.backend.to_host(a) for a in (cells.k, cells.v))
            results.append((picks, [s.tokens for s in cells.sequences], k, v))
        (picks, held, k, v), (chain_picks, chain_held, chain_k, chain_v) = results
        assert chain_picks == picks and chain_held == held
        np.testing.assert_array_equal(chain_k, k)
        np.testing.assert_array_equal(chain_v, v)


def _spy(monkeypatch, owner, name: str, note) -> list:
    """owner.name wrapped to record note(*its arguments) in the list returned."""
    seen, original = [], getattr(owner, name)

    def spied(*args):
        seen.append(note(*args))
        return original(*args)

    monkeypatch.setattr(owner, name, spied)
    return seen


def test_the_engine_chains_greedy_steps_as_single_ones(tiny_model, monkeypatch):
    """Chained steps (backend.chain_steps) give a greedy request the tokens, text and end of
    single steps, also when a stop string or the budget ends it inside a chain, and leave
    its cells as single steps do (the next prompt reuses as many); a sampling neighbour
    turns chaining off and is unchanged."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 296, 12).tolist()
    runs, stop = [], None
    for chain in (1, 4):
        m = Model(tiny_model, backend="cpu", n_ctx=96, parallel=2)
        monkeypatch.setattr(m.engine.transformer.backend, "chain_steps", chain)
        chains = _spy(monkeypatch, m.engine.transformer, "run_chain", lambda *a: a[2])
        whole = m.complete(prompt, max_tokens=11, temperature=0)
        stop = stop or whole.text[len(whole.text) // 2 :][:2]  # the single steps' own
        stopped = m.complete(prompt, max_tokens=30, temperature=0, stop=[stop])
        again = m.complete(prompt + stopped.tokens + [3], max_tokens=5, temperature=0)
        streams = [
            m.generate(prompt, max_tokens=9, temperature=0),
            m.generate(prompt[:5], **_settings(1)),
        ]
        for s in streams:
            for _ in s:
                pass
        m.close()
        runs.append((whole, stopped, again, [s.completion.tokens for s in streams]))
        assert all(2 <= c <= chain for c in chains) and len(chains) >= (chain > 1)  # 1: none
    (whole, stopped, again, mixed), (c_whole, c_stopped, c_again, c_mixed) = runs
    assert whole.finish_reason == c_whole.finish_reason == "length"
    assert (c_whole.tokens, c_whole.text) == (whole.tokens, whole.text)
    assert stopped.finish_reason == c_stopped.finish_reason == "stop"
    assert (len(stopped.tokens) - 1) % 4 != 0  # inside a chain (the first: the prompt's pass)
    assert (c_stopped.tokens, c_stopped.text) == (stopped.tokens, stopped.text)
    assert c_again.prefilled_tokens == again.prefilled_tokens and c_again.tokens == again.tokens
    assert c_mixed == mixed
