"""`fastrun perplexity`: llama-perplexity's chunking and scoring, and the KL-divergence base."""

import math
import os

import numpy as np
import pytest

from fastrun.runner.api import Model
from fastrun.runner.cli import main
from fastrun.runner.logprob_file import LogprobFile
from fastrun.runner.perplexity import chunk_tokens, evaluate

TEXT = " ".join(f"the {w} in the text is there" for w in range(120))


@pytest.fixture(scope="module")
def model(tiny_model):
    m = Model(tiny_model, backend="cpu", n_ctx=64)
    yield m
    m.close()


def test_scores_the_second_half_of_each_chunk(model):
    tokens = model.tokenize(TEXT)
    result = evaluate(model, tokens, 64, n_chunks=3)
    nll = []
    for c in range(3):
        ids = tokens[64 * c : 64 * (c + 1)]
        lp = model.logprobs(ids)
        nll += [-lp[j, ids[j + 1]] for j in range(32, 63)]
    assert result.n_chunks == 3 and result.scores.count == 3 * 31
    ppl, err = result.scores.ppl()
    assert ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)
    assert err == pytest.approx(ppl * np.std(nll) / math.sqrt(len(nll) - 1), rel=1e-3)


def test_passes_smaller_than_a_chunk(model, monkeypatch):
    """A chunk longer than one prefill pass: passes of 20 tokens, one across the half."""
    from fastrun.runner.models import base

    tokens = model.tokenize(TEXT)
    whole = evaluate(model, tokens, 64, n_chunks=2).scores.ppl()
    monkeypatch.setattr(base, "PREFILL_CHUNK", 20)
    assert evaluate(model, tokens, 64, n_chunks=2).scores.ppl() == pytest.approx(whole, rel=1e-5)


def test_too_short_and_whole_chunks_only(model):
    from fastrun.formats.errors import FastrunError

    with pytest.raises(FastrunError, match="needs at least 128"):
        chunk_tokens(list(range(100)), 64, None)
    assert chunk_tokens(list(range(200)), 64, None).shape == (3, 64)


def test_kl_divergence_against_itself(model, tmp_path):
    tokens = model.tokenize(TEXT)
    base_path = tmp_path / "base.logp"
    saved = evaluate(model, tokens, 64, n_chunks=2, save_to=str(base_path))
    base = LogprobFile(base_path)
    assert base.logprobs.shape == (2, 31, model.config.n_vocab)
    again = evaluate(model, tokens, 64, base=base)
    kl = again.kl_summary()
    assert again.n_chunks == 2
    assert kl["mean_kld"] < 1e-3 and kl["same_top"] == 1.0
    assert kl["ppl_base"] == pytest.approx(saved.scores.ppl()[0], rel=1e-3)


def test_cli(tiny_model, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    base = tmp_path / "base.logp"
    args = ["perplexity", str(tiny_model), str(text), "-c", "64", "--chunks", "2"]
    assert main([*args, "--kl-divergence-base", str(base)]) == 0
    assert "PPL = " in capsys.readouterr().out
    assert main([*args, "--kl-divergence", str(base)]) == 0
    out = capsys.readouterr().out
    assert "Mean KLD:" in out and "Same top p: 100.000" in out
    # an existing base needs --force; a text too short is one line
    assert main([*args, "--kl-divergence-base", str(base)]) == 2
    assert "--force" in capsys.readouterr().err
    text.write_text("short")
    assert main(["perplexity", str(tiny_model), str(text), "-c", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs at least 128" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["base.logp", "text.txt"]


def test_ctrl_c_leaves_no_base(tiny_model, tmp_path, capsys, monkeypatch):
    import fastrun.runner.perplexity as perplexity

    calls = []

    def interrupted(model, ids, bos):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(model, ids, bos)

    real = perplexity._chunk_logprobs
    monkeypatch.setattr(perplexity, "_chunk_logprobs", interrupted)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    base = tmp_path / "base.logp"
    args = ["perplexity", str(tiny_model), str(text), "-c", "64", "--kl-divergence-base", str(base)]
    assert main(args) == 130
    assert "interrupted" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["text.txt"]
