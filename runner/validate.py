"""Checks of what a caller asks for, before it reaches the model: sampling settings, the
context size against memory and the training context, prompt ids and prompt text. Each
problem is one FastrunError (a warning for what merely degrades the output)."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np

from fastrun.formats.errors import FastrunError
from fastrun.runner.kv_cache import storage_rows

MAX_POSITIONS = (1 << 31) - 1  # positions and cache rows are int32 in every kernel
MAX_SEED = (1 << 64) - 1
RANDOM_SEED = -1  # --seed -1: a fresh random seed, as llama.cpp


class FastrunWarning(UserWarning):
    """Something that works but that the user should know: the CLI prints it as one line."""


def warn(message: str) -> None:
    warnings.warn(message, FastrunWarning, stacklevel=3)


def _number(settings: dict, name: str, low: float, high: float = math.inf, above=False) -> None:
    value = settings.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise FastrunError(f"{name} must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise FastrunError(f"{name.replace('_', ' ')} must be a finite number, not {value}")
    if (value <= low if above else value < low) or value > high:
        bound = f"above {low:g}" if above else f"at least {low:g}"
        upper = f" and at most {high:g}" if math.isfinite(high) else ""
        off = " (1 = off)" if name == "repeat_penalty" else ""
        raise FastrunError(f"{name.replace('_', ' ')} must be {bound}{upper}{off}, not {value}")


def check_sampling(settings: dict) -> dict:
    """Sampling settings (SamplingParams' field names) checked; seed -1 becomes None (a
    random seed). Returns the settings to build SamplingParams from."""
    settings = dict(settings)
    _number(settings, "temperature", 0.0)
    _number(settings, "top_k", 0)
    _number(settings, "top_p", 0.0, 1.0)
    _number(settings, "min_p", 0.0, 1.0)
    _number(settings, "repeat_penalty", 0.0, above=True)  # it divides; 1 = off
    _number(settings, "presence_penalty", -math.inf)
    _number(settings, "frequency_penalty", -math.inf)
    _number(settings, "repeat_last_n", 0)
    _number(settings, "max_tokens", 1)
    for name in ("top_k", "repeat_last_n", "max_tokens"):
        if name in settings and not isinstance(settings[name], int | np.integer):
            raise FastrunError(f"{name} must be a whole number, not {settings[name]}")
    seed = settings.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
            raise FastrunError(f"seed must be a whole number, not {seed!r}")
        if not RANDOM_SEED <= seed <= MAX_SEED:
            raise FastrunError(f"seed must be -1 (random) or 0 to {MAX_SEED}, not {seed}")
        settings["seed"] = None if seed == RANDOM_SEED else int(seed)
    stop = settings.get("stop")
    for s in (stop,) if isinstance(stop, str) else stop or ():
        if not isinstance(s, str) or not s:
            raise FastrunError(f"a stop string must be non-empty text, not {s!r}")
    return settings


def available_memory(backend) -> int | None:
    """Bytes the backend can still allocate (None when unknown): the GPU's free memory, or
    the host's MemAvailable."""
    if getattr(backend, "name", None) == "cuda":
        try:
            import cupy

            free = cupy.cuda.runtime.memGetInfo()[0]
            return free + cupy.get_default_memory_pool().free_bytes()
        except Exception:  # no CuPy query: the allocation itself will tell
            return None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def kv_cache_bytes(n_ctx: int, config, backend, n_seq: int = 1, max_pass: int = 512) -> int:
    """Bytes of the keys and values of n_seq sequences of n_ctx positions, whose passes add at
    most max_pass tokens to a sequence (sliding-window layers keep rings: runner/kv_cache.py)."""
    itemsize = np.dtype(backend.zeros((1,)).dtype).itemsize  # float32 on the CPU, fp16 on CUDA
    windows = [at.window for at in config.block().layers]
    rows = sum(layers * n for layers, n in storage_rows(windows, n_seq, n_ctx, max_pass).values())
    return 2 * rows * config.n_head_kv * config.head_dim * itemsize


def check_context_size(n_ctx, config, backend, n_seq: int = 1, max_pass: int = 512) -> None:
    """Refuse a context (of each of n_seq parallel sequences) that the KV cache cannot hold in
    memory; warn above the training context."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int | np.integer):
        raise FastrunError(f"context size must be a whole number, not {n_ctx!r}")
    if not 2 <= n_ctx <= MAX_POSITIONS or not 1 <= n_seq <= MAX_POSITIONS // n_ctx:
        raise FastrunError(
            f"context size {n_ctx} x {n_seq} sequences is outside 2..{MAX_POSITIONS}"
        )
    need = kv_cache_bytes(n_ctx, config, backend, n_seq, max_pass)
    free = available_memory(backend)
    if free is not None and need > free:
        sequences = f" x {n_seq} parallel sequences" if n_seq > 1 else ""
        raise FastrunError(
            f"context size {n_ctx}{sequences} needs {need / 2**30:.1f} GiB for its KV cache; "
            f"{free / 2**30:.1f} GiB of memory is available (lower --ctx-size)"
        )
    if n_ctx > config.n_ctx_train:
        warn(
            f"context size {n_ctx} is above the model's training context "
            f"({config.n_ctx_train}): output past it may degrade"
        )


def check_token_ids(ids: list[int], n_vocab: int) -> list[int]:
    """Prompt ids given as numbers: each must be a row of the embedding."""
    bad = next((i for i in ids if not 0 <= i < n_vocab), None)
    if bad is not None:
        raise FastrunError(f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
    return ids


def check_prompt_text(text: str, tokenizer, n_ctx: int) -> str:
    """Refuse, before tokenizing it, a text too long for the context whatever its tokens:
    tokenizing hundreds of megabytes at once can abort the process."""
    limit = n_ctx * tokenizer.max_chars_per_token
    if len(text) > limit:
        raise FastrunError(
            f"the prompt has {len(text)} characters, more than a context of {n_ctx} tokens "
            f"can hold (raise it with --ctx-size)"
        )
    return text
