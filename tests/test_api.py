"""The Python API: fastrun.load and the Model methods."""

import numpy as np

import fastrun


def test_load_generate_chat(smollm2_path):
    model = fastrun.load(str(smollm2_path), n_ctx=256)
    ids = model.tokenize("Hello world")
    assert model.detokenize(ids) == "Hello world"
    pieces = list(model.generate("The capital of France is", temperature=0, max_tokens=4))
    assert all(isinstance(p.id, int) for p in pieces)
    assert "".join(pieces).strip().startswith("Paris")
    reply = "".join(
        model.chat([{"role": "user", "content": "Say hello."}], temperature=0, max_tokens=8)
    )
    assert reply and model.last.finish_reason in ("stop", "length")
    lp = model.logprobs(ids)
    assert lp.shape == (len(ids), 49152) and np.isfinite(lp).all()


def test_load_by_registry_name():
    model = fastrun.load("smollm2-135m-instruct", n_ctx=64)
    assert model.config.arch == "llama" and model.n_ctx == 64
