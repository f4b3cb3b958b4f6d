"""Arguments checked before they reach the model: sampling settings, context size, prompts."""

import warnings

import pytest

from fastrun.formats.errors import FastrunError
from fastrun.runner.api import Model, sampling_params


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"repeat_penalty": 0.0}, r"repeat penalty must be above 0 \(1 = off\)"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 1.5}, "top p must be at least 0 and at most 1"),
        ({"top_k": -1}, "top k must be at least 0"),
        ({"max_tokens": 0}, "max tokens must be at least 1"),
        ({"seed": -2}, "seed must be -1 .random. or 0 to"),
        ({"seed": 1.5}, "seed must be a whole number"),
        ({"stop": [""]}, "stop string must be non-empty"),
        ({"presence_penalty": float("inf")}, "finite"),
    ],
)
def test_bad_sampling_settings(settings, message):
    with pytest.raises(FastrunError, match=message):
        sampling_params(**settings)


def test_seed_minus_one_is_random():
    assert sampling_params(seed=-1).seed is None
    assert sampling_params(seed=7).seed == 7


def test_context_size_against_memory_and_training(tiny_model):
    with pytest.raises(FastrunError, match=r"needs .* GiB for its KV cache"):
        Model(tiny_model, backend="cpu", n_ctx=1 << 28)
    with pytest.raises(FastrunError, match="outside 2.."):
        Model(tiny_model, backend="cpu", n_ctx=1 << 40)
    with pytest.warns(UserWarning, match="above the model's training context"):
        Model(tiny_model, backend="cpu", n_ctx=512).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Model(tiny_model, backend="cpu", n_ctx=256).close()  # the training context itself


def test_prompt_ids_and_overlong_text_are_refused_before_the_model(tiny_model):
    tiny = Model(tiny_model, backend="cpu", n_ctx=64)
    with pytest.raises(FastrunError, match="token id 300 is outside the vocabulary"):
        tiny.complete([1, 300], max_tokens=1)
    with pytest.raises(FastrunError, match="token id -1"):
        tiny.logprobs([-1, 2])
    with pytest.raises(FastrunError, match="characters, more than a context of 64 tokens"):
        tiny.complete("x" * 10_000_000, max_tokens=1)
    tiny.close()
