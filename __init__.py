"""fastrun: run GGUF language models fast from Python, on the CPU or an NVIDIA GPU.

import fastrun
model = fastrun.load("smollm2-135m-instruct")
for piece in model.generate("Once upon a time", max_tokens=32):
    print(piece, end="")
"""

__version__ = "0.1.0"

__all__ = ["__version__", "load"]


def load(model, backend="cpu", n_ctx=None, **kwargs):
    """Load a model by path or registry name; see fastrun.runner.api.load."""
    from fastrun.runner.api import load as _load

    return _load(model, backend=backend, n_ctx=n_ctx, **kwargs)
