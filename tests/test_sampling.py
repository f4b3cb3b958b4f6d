"""The sampler: greedy, seeds, the filters, penalties; stop strings in the generation loop."""

import numpy as np
import pytest

from fastrun.backends.reference import ReferenceBackend
from fastrun.runner.api import Model, sampling_params
from fastrun.runner.generate import _held_back
from fastrun.runner.sampling import Candidates, Sampler, SamplingParams

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32))


def draws(params, n=400):
    s = Sampler(params)
    return [s(LOGITS, []) for _ in range(n)]


def test_greedy_and_seed():
    assert Sampler(SamplingParams.greedy())(LOGITS, []) == 0
    a = draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    b = draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    assert a == b and len(set(a)) == 5


def test_filters():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=1))) == {
        0,
        1,
    }
    assert set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0, seed=1))) == {
        0,
        1,
    }
    assert set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25, seed=1))) == {
        0,
        1,
        2,
    }
    cold = draws(SamplingParams(temperature=0.05, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    assert cold.count(0) > 390


def test_penalties():
    logits = np.array([2.0, 1.9, -1.0], np.float32)
    greedy = SamplingParams.greedy
    assert Sampler(greedy(repeat_penalty=1.5))(logits, [0]) == 1
    assert Sampler(greedy(presence_penalty=0.5))(logits, [0]) == 1
    assert Sampler(greedy(frequency_penalty=0.06))(logits, [0, 0]) == 1
    assert Sampler(greedy(frequency_penalty=0.06))(logits, [0]) == 0


def test_stop_string_holdback():
    assert _held_back("hello wor", ("world",)) == 3
    assert _held_back("hello", ("xyz",)) == 0


def test_unknown_setting_is_a_user_error():
    from fastrun.formats import FastrunError

    with pytest.raises(FastrunError, match="unknown sampling"):
        sampling_params(temprature=0.5)


def test_generation_stops(tiny_model):
    m = Model(tiny_model, n_ctx=128)
    out = m.complete("the the", temperature=0, max_tokens=5)
    assert out.finish_reason in ("length", "stop") and len(out.tokens) <= 5
    full = m.complete("the the", temperature=0, max_tokens=20).text
    if len(full) > 4:
        stop = full[2:4]
        cut = m.complete("the the", temperature=0, max_tokens=20, stop=[stop])
        assert cut.finish_reason == "stop" and stop not in cut.text and full.startswith(cut.text)
    a = m.complete("the", temperature=1.0, seed=3, max_tokens=10).tokens
    b = m.complete("the", temperature=1.0, seed=3, max_tokens=10).tokens
    assert a == b


def test_candidates_draw_as_the_whole_row():
    """The backend's top-k candidates give the same draws as the whole row of logits."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(1000).astype(np.float32) * 3
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=11)
    ids, values = ReferenceBackend().top_k(logits[None], Sampler(params).candidates)
    whole, chosen = Sampler(params), Sampler(params)
    top = Candidates(ids[0], values[0])
    assert [whole(logits, []) for _ in range(200)] == [chosen(top, []) for _ in range(200)]
    assert Sampler(SamplingParams.greedy()).candidates == 1
    assert Sampler(SamplingParams.greedy())(Candidates(ids[0, :1], values[0, :1]), []) == ids[0, 0]
    assert Sampler(SamplingParams(top_k=0)).candidates == 0  # the whole row is needed
    assert Sampler(SamplingParams(repeat_penalty=1.1)).candidates == 0


def test_draws_survive_logits_that_are_not_finite():
    """A damaged model's NaN or inf logits: a token is drawn, never an exception."""
    sampler = Sampler(SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1, seed=1))
    ids = np.arange(4, dtype=np.int32)
    for values in ([np.nan, 1, 2, 3], [3, np.nan, 2, 1], [np.inf, 1, np.nan, 0],
                   [np.nan] * 4, [3, 2, -np.inf, -np.inf]):  # fmt: skip
        logits = np.array(values, np.float32)
        assert 0 <= sampler(Candidates(ids, logits), []) < 4
        assert 0 <= sampler(logits.copy(), []) < 4
    assert sampler(np.array([0, np.inf, 1, np.nan], np.float32), []) == 1
