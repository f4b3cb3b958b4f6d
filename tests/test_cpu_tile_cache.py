"""The CPU backend's tile cache: later loads map the tiles written by the first, and any file
that does not fit what is being loaded is ignored and rewritten, outputs unchanged."""

import os

import numpy as np
import pytest
from helpers import write_tiny_model

from fastrun.backends import get_backend
from fastrun.backends.cpu import tile_cache
from fastrun.formats.gguf import GGUFFile
from fastrun.runner.models import model_class


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "tiles"
    monkeypatch.setenv("FASTRUN_TILE_CACHE", str(folder))
    return folder


@pytest.fixture
def model_path(tmp_path):
    return write_tiny_model(tmp_path / "tiny-q4_k.gguf", qtype="Q4_K", n_embd=256, n_ff=512)


def load(path):
    """(logits of a short prompt, whether the stack's tiles are a map of a cache file)."""
    f = GGUFFile(path)
    tf = model_class(f.architecture)(f, get_backend("cpu", threads=1))
    cache = tf.new_cache(16)
    logits = tf.forward([1, 5, 9, 200], cache)
    mapped = tf._stack.file.base is not None and not isinstance(tf._stack.file.base, np.ndarray)
    return logits, mapped


def cache_file(folder):
    files = list(folder.glob("*.tiles"))
    assert len(files) == 1
    return files[0]


def test_a_second_load_maps_the_tiles_of_the_first(cache_dir, model_path):
    first, mapped_first = load(model_path)
    second, mapped_second = load(model_path)
    assert not mapped_first and mapped_second
    np.testing.assert_array_equal(first, second)


def test_a_changed_model_file_is_repacked(cache_dir, model_path):
    load(model_path)
    st = os.stat(model_path)
    os.utime(model_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _, mapped = load(model_path)
    assert not mapped
    assert load(model_path)[1]  # rewritten for the new mtime


def test_a_changed_tile_layout_is_repacked(cache_dir, model_path, monkeypatch):
    load(model_path)
    monkeypatch.setattr(tile_cache, "layout_digest", lambda: "another layout")
    assert not load(model_path)[1]


@pytest.mark.parametrize(
    "damage",
    ["truncated", "extended", "magic", "header length", "header json", "header field", "tiles"],
)
def test_a_damaged_cache_file_is_ignored_and_rewritten(cache_dir, model_path, damage):
    expected, _ = load(model_path)
    path = cache_file(cache_dir)
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[8:16], "little")
    if damage == "truncated":
        del data[-100:]
    elif damage == "extended":
        data += b"\0" * 64
    elif damage == "magic":
        data[:8] = b"NOTTILES"
    elif damage == "header length":
        data[8:16] = (1 << 40).to_bytes(8, "little")
    elif damage == "header json":
        data[16] = 0xFF
    elif damage == "header field":  # same length, another weight shape
        data[16 : 16 + n] = data[16 : 16 + n].replace(b'"Q4_K", 256', b'"Q4_K", 257', 1)
        assert b"257" in data
    else:  # the first tile's bytes: the spot check against a fresh repack fails
        at = len(data) - tile_cache.json.loads(data[16 : 16 + n])["bytes"]
        data[at + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    logits, mapped = load(model_path)
    assert not mapped
    np.testing.assert_array_equal(logits, expected)
    assert load(model_path)[1]  # the rewritten file serves the next load


def test_an_unwritable_cache_costs_only_the_repacking(tmp_path, monkeypatch, model_path):
    blocker = tmp_path / "a file, not a folder"
    blocker.write_text("")
    monkeypatch.setenv("FASTRUN_TILE_CACHE", str(blocker / "tiles"))
    assert not load(model_path)[1]


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch, model_path):
    monkeypatch.setenv("FASTRUN_TILE_CACHE", "off")
    load(model_path)
    assert not load(model_path)[1]
