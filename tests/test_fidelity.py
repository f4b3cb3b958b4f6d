"""Fidelity against llama.cpp's own numbers (../shared/golden): teacher-forced log-probs and
greedy continuations. SmolLM2 and Gemma 3 always run; the Qwen models are marked slow."""

import json

import numpy as np
import pytest
from helpers import GOLDEN, golden, real_model

from fastrun.runner.api import Model

MODELS = [
    "smollm2-135m-instruct",
    "gemma3-270m",
    pytest.param("qwen2.5-coder-0.5b-instruct", marks=pytest.mark.slow),
    pytest.param("qwen2.5-coder-1.5b-instruct", marks=pytest.mark.slow),
]
# Where llama.cpp's own top-2 log-probs are closer than this, either side may pick either
# token. The golden README uses 0.1; fastrun's logits move by up to ~0.1 nats under changes
# as small as float32 instead of float64 sums in RMSNorm (see the issue #3 note), so a
# margin twice that is the honest bound for an implementation that is not bit-identical.
NEAR_TIE = 0.25
# (top-1 agreement, mean KL) each teacher text must reach: llama.cpp's own numbers. The CPU
# backend computes as the golden data's AVX-512 build of llama.cpp does, every rounding and
# every float sum in its order (its tinyBLAS, vec_dot, repacked and tiled products, its
# RoPE, RMSNorm, GELU table, softmax and attention: tests/test_llamacpp_numerics.py), on
# every instruction set, so the teacher-forced log-probs are its own to float noise in the
# log-softmax. (Before the products followed llama.cpp's sum order, Gemma 3 reached only
# 93.7 % / 0.0050 and 96.9 % / 0.0074; llama.cpp's own AVX2 build, whose products add in
# another order, 94.5 % / 0.0049 and 96.1 % / 0.0067: BENCHMARKS.md.)
EXACT = (1.0, 1e-5)
# Other backends (CUDA) add in their own orders: issue #3's bounds, looser for Gemma 3, whose
# 8-bit activation rounding carries a last-bit difference on from layer to layer.
APPROXIMATE = {"gemma3-270m": (0.935, 0.008)}
DEFAULT_BOUNDS = (0.95, 0.006)


@pytest.fixture(scope="module", params=MODELS)
def loaded(request):
    return Model(real_model(request.param), n_ctx=512), golden(request.param), request.param


@pytest.mark.parametrize("text", ["apache", "jsondec"])
def test_teacher_forced_logprobs(loaded, text):
    model, ref, name = loaded
    tokens = ref[f"teacher.{text}.tokens"]
    top_ids, top_lp = ref[f"teacher.{text}.top_ids"], ref[f"teacher.{text}.top_logprobs"]
    lp = model.logprobs(tokens)
    top1 = (lp.argmax(axis=1) == top_ids[:, 0])[1:].mean()
    ours = np.take_along_axis(lp, top_ids, axis=1)
    kl = (np.exp(top_lp) * (top_lp - ours)).sum(axis=1)[1:].mean()
    print(f"{text}: top-1 {top1:.4f}, KL {kl:.5f}")
    exact = model.transformer.backend.name == "cpu"
    least_top1, most_kl = EXACT if exact else APPROXIMATE.get(name, DEFAULT_BOUNDS)
    assert top1 >= least_top1 and kl <= most_kl


@pytest.mark.parametrize("text", ["story", "fact", "code"])
def test_greedy_matches_up_to_near_tie(loaded, text):
    model, ref, _ = loaded
    prompt = json.loads((GOLDEN / "texts.json").read_text())["greedy"][text]
    ids = ref[f"greedy.{text}.prompt_tokens"].tolist()
    assert model.tokenize(prompt, special=True) == ids
    expect = ref[f"greedy.{text}.tokens"].tolist()
    top2 = ref[f"greedy.{text}.top2_logprobs"]
    got = model.complete(ids, temperature=0, max_tokens=len(expect)).tokens
    ties = [i for i in range(len(expect)) if top2[i, 0] - top2[i, 1] < NEAR_TIE]
    check = ties[0] if ties else len(expect)
    assert got[:check] == expect[:check]
