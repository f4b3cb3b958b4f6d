"""End-to-end model behaviour on tiny synthetic GGUF files: CPU vs the NumPy reference, the
KV cache (prefix reuse, rollback), and clear errors for what fastrun does not run."""

import numpy as np
import pytest
from helpers import write_tiny_model

from fastrun.backends import get_backend
from fastrun.formats import FastrunError, GGUFFile
from fastrun.runner.api import Model
from fastrun.runner.batch import Batch
from fastrun.runner.models import model_class


def _logits(path, backend, ids):
    with GGUFFile(path) as f:
        model = model_class(f.architecture)(f, get_backend(backend))
        return model.forward(ids, model.new_cache(64), all_logits=True)


@pytest.mark.parametrize(
    "arch, qtype", [("llama", "Q4_0"), ("llama", "Q4_K"), ("qwen2", "Q5_0"), ("qwen2", "Q6_K")]
)
def test_cpu_matches_reference_end_to_end(tmp_path, arch, qtype):
    path = write_tiny_model(tmp_path / "m.gguf", arch=arch, qtype=qtype, tied=arch == "llama")
    ids = [5, 17, 200, 3, 99, 42, 7]
    cpu, ref = _logits(path, "cpu", ids), _logits(path, "reference", ids)
    # Float sums in another order flip a few 8-bit activation roundings (each worth 1/127 of
    # a block's max); through two layers that stays near 1% of the logit range. A real bug is
    # off by the whole range.
    np.testing.assert_allclose(cpu, ref, rtol=0, atol=2e-2 * np.abs(ref).max())


@pytest.mark.parametrize("arch, qtype", [("llama", "Q4_1"), ("qwen2", "Q4_K")])
def test_compiled_blocks_equal_the_steps_one_by_one(tmp_path, arch, qtype):
    """The CPU backend's one-call stack of blocks computes exactly what the steps do."""
    path = write_tiny_model(tmp_path / "m.gguf", arch=arch, qtype=qtype)
    ids = [5, 17, 200, 3, 99, 42, 7]
    with GGUFFile(path) as f:
        model = model_class(f.architecture)(f, get_backend("cpu"))
        assert model._stack is not None
        stacked = model.forward(ids, model.new_cache(64), all_logits=True)
        cache = model.new_cache(64)
        stacked_decode = [model.forward([i], cache) for i in ids]
        model._stack = None
        np.testing.assert_array_equal(
            model.forward(ids, model.new_cache(64), all_logits=True), stacked
        )
        cache = model.new_cache(64)
        np.testing.assert_array_equal([model.forward([i], cache) for i in ids], stacked_decode)


def test_prefix_reuse_and_rollback_give_the_same_logits(tiny_model):
    m = Model(tiny_model, n_ctx=64)
    ids = [5, 17, 200, 3, 99, 42, 7, 8, 9]
    fresh = m.transformer.forward(ids, m.transformer.new_cache(64))
    cache = m.transformer.new_cache(64)
    m.transformer.forward(ids[:5], cache)
    m.transformer.forward([1, 2, 3], cache)  # a draft that gets rejected
    cache.trim(5)
    assert cache.tokens == ids[:5]
    again = m.transformer.forward(ids[5:], cache)
    np.testing.assert_allclose(again, fresh, rtol=1e-5, atol=1e-5)
    assert cache.common_prefix(ids + [1]) == len(ids)


def test_context_overflow_is_a_clear_error(tiny_model):
    m = Model(tiny_model, n_ctx=8)
    with pytest.raises(FastrunError, match="context holds 8"):
        list(m.generate(list(range(1, 20))))


def test_unsupported_architecture(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(FastrunError, match="unsupported architecture 'mamba'"):
        Model(path)


def test_logprobs_shape_and_normalization(tiny_model):
    m = Model(tiny_model, n_ctx=64)
    lp = m.logprobs([5, 6, 7])
    assert lp.shape == (3, m.config.n_vocab) and lp.dtype == np.float32
    np.testing.assert_allclose(np.exp(lp).sum(axis=1), 1.0, rtol=1e-4)


def test_batch_decode_matches_one_sequence_at_a_time(tiny_model):
    """A pass over sequences of one KVCells gives each sequence its own logits."""
    f = GGUFFile(str(tiny_model))
    model = model_class(f.architecture)(f, get_backend("cpu"))
    prompts = [[5, 6, 7], [100, 3], [42, 43, 44, 45, 46]]
    cells = model.new_cells(3, 32)
    alone = []
    for s, p in enumerate(prompts):
        model.forward(p, cells.sequences[s])
        cache = model.new_cache(32)
        model.forward(p, cache)
        alone.append(model.forward([9], cache)[-1])
    batch = Batch()
    for s in cells.sequences:
        batch.add(s, [9])
    np.testing.assert_allclose(model.run(batch, cells), np.stack(alone), rtol=1e-5, atol=1e-5)
    assert [s.length for s in cells.sequences] == [4, 3, 6]
