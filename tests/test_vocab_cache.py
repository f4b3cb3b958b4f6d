"""The tokenizer's vocabulary cache (runner/vocab_cache.py): a later build reads the decoded
vocabulary and merges back, and a file whose bytes differ never gets another file's lists."""

import dataclasses
import os

import pytest
from helpers import write_tiny_model

from fastrun.formats import keys
from fastrun.formats.errors import GGUFError
from fastrun.formats.gguf import GGUFFile
from fastrun.runner import vocab_cache
from fastrun.runner.tokenizer import Tokenizer

TEXT = "the theater in a hurry <|im_start|> 123"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("FASTRUN_TILE_CACHE", str(folder))
    return folder


def build(path) -> tuple[Tokenizer, GGUFFile]:
    f = GGUFFile(path)
    return Tokenizer.from_gguf(f), f


def test_second_build_reads_the_cache(tmp_path, cache_dir):
    path = write_tiny_model(tmp_path / "a.gguf")
    first, f1 = build(path)
    assert len(list(cache_dir.glob("*.vocab"))) == 1
    second, f2 = build(path)
    assert second.tokens == first.tokens
    assert second.encode(TEXT, special=True) == first.encode(TEXT, special=True)
    # from the cache: the file's string arrays were never decoded
    assert f2.metadata.decoded(keys.TOKENS) is None and f2.metadata.decoded(keys.MERGES) is None
    assert f1.metadata.decoded(keys.TOKENS) is not None


def test_other_bytes_other_file(tmp_path, cache_dir):
    """Same path, size and timestamps, other vocabulary: the cache is not consulted for it."""
    path = write_tiny_model(tmp_path / "a.gguf")
    first, _ = build(path)
    stat = os.stat(path)
    data = path.read_bytes()
    old, new = b"<extra_270>", b"<extra_999>"
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second, _ = build(path)
    assert "<extra_999>" in second.tokens and "<extra_270>" not in second.tokens
    assert len(list(cache_dir.glob("*.vocab"))) == 2


def test_broken_cache_file_is_rebuilt(tmp_path, cache_dir):
    path = write_tiny_model(tmp_path / "a.gguf")
    first, _ = build(path)
    (cache_file,) = cache_dir.glob("*.vocab")
    for junk in (b"", b"\x00garbage", cache_file.read_bytes()[:100]):
        cache_file.write_bytes(junk)
        again, f = build(path)
        assert again.tokens == first.tokens
        assert f.metadata.decoded(keys.TOKENS) is not None  # decoded: the file was not used


def test_off(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTRUN_TILE_CACHE", "off")
    path = write_tiny_model(tmp_path / "a.gguf")
    tok, _ = build(path)
    assert vocab_cache.load(GGUFFile(path))[1] is None
    assert tok.n_vocab == 300


def test_count_checks_without_decoding(tmp_path):
    f = GGUFFile(write_tiny_model(tmp_path / "a.gguf"))
    assert f.count(keys.TOKENS) == 300
    assert f.metadata.decoded(keys.TOKENS) is None
    assert f.count(keys.TOKENS) == len(f.get(keys.TOKENS))
    assert f.count("no.such.key") == 0


def test_count_applies_the_schema(tmp_path, monkeypatch):
    from fastrun.formats import schema

    f = GGUFFile(write_tiny_model(tmp_path / "a.gguf"))
    spec = schema.SCHEMA[keys.TOKENS]
    monkeypatch.setitem(schema.SCHEMA, keys.TOKENS, dataclasses.replace(spec, max_len=10))
    with pytest.raises(GGUFError, match="length 300"):
        f.count(keys.TOKENS)
