"""Tokenizers against llama.cpp's own ids for the four golden models."""

import json

import pytest
from helpers import GOLDEN, GOLDEN_MODELS, golden, real_model

from fastrun.runner.tokenizer import Tokenizer

TEXTS = json.loads((GOLDEN / "texts.json").read_text())["tokenize"] if GOLDEN.exists() else {}


@pytest.fixture(scope="module", params=list(GOLDEN_MODELS))
def model(request):
    return request.param, Tokenizer.from_gguf(real_model(request.param)), golden(request.param)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_encode_matches_llama_cpp(model, name):
    _, tok, ref = model
    text = TEXTS[name]
    assert tok.encode(text, add_bos=False, special=False) == ref[f"tok.{name}.ids"].tolist()
    assert tok.encode(text, special=True) == ref[f"tok.{name}.ids_special"].tolist()
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_stream_decoder_never_splits_characters(model):
    _, tok, _ = model
    text = TEXTS["unicode"]
    ids = tok.encode(text, add_bos=False)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_end_of_generation_tokens(model):
    name, tok, _ = model
    assert tok.eos_id in tok.eog_ids
    if "qwen" in name or "smollm" in name:
        assert tok.token_to_id["<|im_end|>"] in tok.eog_ids
