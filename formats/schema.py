"""The metadata keys fastrun reads, each with its type and range, in one table.

GGUFFile.get checks a value against its entry when it is read, so a count stored as a string, an
infinite epsilon or a token list of integers becomes one GGUFError naming the key, never a
traceback in the code that uses it. Relations between keys (head counts that divide, special
ids inside the vocabulary) are checked where both sides are known: the model config and the
tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fastrun.formats import keys
from fastrun.formats.errors import GGUFError, shown

# Value kinds. Arrays are NumPy arrays (numeric items) or lists (string items), as the reader
# returns them.
INT, FLOAT, BOOL, STR = "an integer", "a number", "a boolean", "a string"
STRINGS, INTS, FLOATS = "an array of strings", "an array of integers", "an array of numbers"

_I32 = (1 << 31) - 1
MAX_TEMPLATE_CHARS = 1 << 20  # real chat templates are a few KB; tool-calling ones under 100 KB


@dataclass(frozen=True)
class KeySpec:
    """What a key's value must be: its kind, then a range for numbers (of the items, for a
    numeric array) and a length range for strings and arrays; bounds are inclusive."""

    kind: str
    low: float | None = None
    high: float | None = None
    min_len: int = 0
    max_len: int | None = None
    positive: bool = False  # a number strictly above 0 (a divisor, a logarithm's base)


def _count(high: int) -> KeySpec:
    return KeySpec(INT, low=1, high=high)


def _token_id() -> KeySpec:
    return KeySpec(INT, low=0, high=_I32)  # below the vocabulary size: checked by the tokenizer


SCHEMA: dict[str, KeySpec] = {
    keys.ARCHITECTURE: KeySpec(STR, min_len=1, max_len=64),
    keys.NAME: KeySpec(STR, max_len=4096),
    keys.CONTEXT_LENGTH: _count(_I32),
    keys.EMBEDDING_LENGTH: _count(1 << 20),
    keys.FEED_FORWARD_LENGTH: _count(1 << 22),
    keys.BLOCK_COUNT: _count(1 << 12),
    keys.HEAD_COUNT: _count(1 << 14),
    keys.HEAD_COUNT_KV: _count(1 << 14),
    keys.KEY_LENGTH: _count(1 << 14),
    keys.VALUE_LENGTH: _count(1 << 14),
    keys.RMS_EPS: KeySpec(FLOAT, low=0.0, high=1.0),
    keys.ROPE_DIMENSION_COUNT: KeySpec(INT, low=0, high=1 << 14),
    keys.ROPE_FREQ_BASE: KeySpec(FLOAT, high=1e12, positive=True),
    keys.ROPE_SCALING_TYPE: KeySpec(STR, max_len=64),
    keys.ROPE_SCALING_FACTOR: KeySpec(FLOAT, low=0.0, high=1e6),
    keys.ROPE_SCALE_LINEAR: KeySpec(FLOAT, low=0.0, high=1e6),
    keys.VOCAB_SIZE: _count(1 << 24),
    keys.SLIDING_WINDOW: _count(_I32),
    # gemma3's pattern: every n-th layer attends globally (an array per layer is refused:
    # fastrun reads the count only)
    keys.SLIDING_WINDOW_PATTERN: _count(1 << 12),
    keys.ROPE_FREQ_BASE_SWA: KeySpec(FLOAT, high=1e12, positive=True),
    keys.ATTN_SOFTCAP: KeySpec(FLOAT, low=0.0, high=1e6),
    keys.FINAL_SOFTCAP: KeySpec(FLOAT, low=0.0, high=1e6),
    keys.ROPE_ORIG_CONTEXT: _count(_I32),
    keys.ROPE_ATTN_FACTOR: KeySpec(FLOAT, low=0.0, high=1e3),
    keys.TOKENIZER_MODEL: KeySpec(STR, max_len=64),
    keys.TOKENIZER_PRE: KeySpec(STR, max_len=64),
    keys.TOKENS: KeySpec(STRINGS, min_len=1, max_len=1 << 24),
    keys.SCORES: KeySpec(FLOATS),
    keys.TOKEN_TYPE: KeySpec(INTS, low=0, high=keys.TOKEN_BYTE),
    keys.MERGES: KeySpec(STRINGS),
    keys.BOS_ID: _token_id(),
    keys.EOS_ID: _token_id(),
    keys.EOT_ID: _token_id(),
    keys.ADD_BOS: KeySpec(BOOL),
    keys.ADD_EOS: KeySpec(BOOL),
    keys.ADD_SPACE_PREFIX: KeySpec(BOOL),
    keys.CHAT_TEMPLATE: KeySpec(STR, max_len=MAX_TEMPLATE_CHARS),
}


def _describe(value) -> str:
    """A short description of a value of the wrong kind, for the error line."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.size} {value.dtype} values"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _kind_problem(spec: KeySpec, value) -> str | None:
    kind = spec.kind
    if kind == INT:
        ok = type(value) is int
    elif kind == FLOAT:
        ok = type(value) in (int, float)
    elif kind == BOOL:
        ok = type(value) is bool or (type(value) is int and value in (0, 1))
    elif kind == STR:
        ok = type(value) is str
    elif kind == STRINGS:
        # GGUF arrays hold one item type, so the first item tells the kind of all of them
        ok = type(value) is list and (not value or type(value[0]) is str)
    elif kind == INTS:
        ok = isinstance(value, np.ndarray) and value.dtype.kind in "iu"
    else:  # FLOATS
        ok = isinstance(value, np.ndarray) and value.dtype.kind == "f"
    return None if ok else f"is {_describe(value)}, expected {kind}"


def _range_problem(spec: KeySpec, value) -> str | None:
    if spec.kind in (STR, STRINGS, INTS, FLOATS):
        n = len(value)
        if n < spec.min_len or (spec.max_len is not None and n > spec.max_len):
            bound = f"{spec.min_len}..{spec.max_len if spec.max_len is not None else ''}"
            return f"has length {n}, expected {bound}"
    if spec.kind in (INTS, FLOATS):
        if value.size == 0:
            return None
        if spec.kind == FLOATS and np.isnan(value).any():
            return "holds NaN"
        lo, hi = value.min(), value.max()
    elif spec.kind in (INT, FLOAT):
        if spec.kind == FLOAT and not math.isfinite(value):
            return f"is {value}, expected a finite number"
        lo = hi = value
    else:
        return None
    if spec.positive and lo <= 0:
        return f"is {lo}, expected a number above 0"
    if (spec.low is not None and lo < spec.low) or (spec.high is not None and hi > spec.high):
        low = "" if spec.low is None else spec.low
        high = "" if spec.high is None else spec.high
        shown = lo if spec.low is not None and lo < spec.low else hi
        return f"{'holds' if spec.kind in (INTS, FLOATS) else 'is'} {shown}, outside {low}..{high}"
    return None


def check(key: str, value, name: str | None = None):
    """The value of a key (its SCHEMA spelling, "{arch}" unfilled) if it is of the declared
    kind and range, as int/float/bool where the kind says so; GGUFError naming `name` (the key
    as the file spells it) otherwise. Keys outside the table pass unchecked."""
    spec = SCHEMA.get(key)
    if spec is None:
        return value
    problem = _kind_problem(spec, value) or _range_problem(spec, value)
    if problem:
        raise GGUFError(f"metadata {shown(name or key)} {problem}")
    if spec.kind == BOOL:
        return bool(value)
    if spec.kind == FLOAT:
        return float(value)
    return value


def check_file(f, arch_keys: bool = True, lazy: tuple[str, ...] = (keys.CHAT_TEMPLATE,)) -> None:
    """Check every key of the table that a GGUFFile holds (`fastrun info`). arch_keys=False
    leaves out the "{arch}." keys: an architecture fastrun does not run may use them otherwise
    (per-layer arrays, no attention heads). The chat template is left to when it is compiled,
    so that a broken one stops only --chat."""
    for key in SCHEMA:
        if key not in lazy and (arch_keys or not key.startswith("{arch}.")):
            f.get(key)
