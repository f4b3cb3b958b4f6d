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


def _bytes_vocab():
    from fastrun.runner.tokenizer import _BYTE_TO_CHAR

    return [_BYTE_TO_CHAR[b] for b in range(256)] + ["ab"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"merges": ["a c"]}, r"merge 0 \('a c'\): 'ac' is not in the vocabulary"),
        ({"merges": ["ab"]}, "not two tokens joined by a space"),
        ({"token_types": [1] * 10}, "257 tokens but 10 token types"),
        ({"scores": [0.0] * 3}, "257 tokens but 3 scores"),
        ({"eos_id": 257}, "eos token id 257 is outside the vocabulary"),
        ({"bos_id": -1}, "bos token id -1"),
        ({"eot_id": 2.0}, "eot token id 2.0"),
    ],
)
def test_inconsistent_tables_are_one_error(kwargs, message):
    from fastrun.formats.errors import FastrunError

    with pytest.raises(FastrunError, match=message):
        Tokenizer("gpt2", _bytes_vocab(), **kwargs)


def test_bad_byte_token_and_invalid_utf8_text():
    from fastrun.formats.errors import FastrunError

    tokens = ["<unk>", "<0xZZ>"] + [f"<0x{b:02X}>" for b in range(256)]
    with pytest.raises(FastrunError, match="byte token 1 is '<0xZZ>'"):
        Tokenizer("llama", tokens, token_types=[2, 6] + [6] * 256)
    t = Tokenizer("gpt2", _bytes_vocab(), merges=["a b"])
    argv_text = b"ab \xff".decode("utf-8", "surrogateescape")  # how Python keeps argv's bytes
    assert t.decode(t.encode(argv_text)) == "ab \ufffd"
    assert t.decode(t.encode("x\ud800y")) == "x\ufffd\ufffd\ufffdy"
