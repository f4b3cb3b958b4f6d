"""A seeded generator of damaged GGUF files, for fuzzing the whole load path.

The file is parsed here with a small reader of its own (independent of the code under test)
into metadata entries and tensor infos, one mutation is applied at the level a hostile file
would use (header counts, a metadata value's type or value, a tensor's shape, type or offset, a
vector's length, the tokenizer's tables, the chat template, raw bytes), and the file is written
back. Used by tests/test_fuzz.py and scripts/fuzz_gguf.py.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

STRING, ARRAY = 8, 9
_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
_TENSOR_TYPES = (0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15, 30)


@dataclass
class Value:
    """A typed metadata value: a scalar, a string, or an array (items: Values' payloads)."""

    vtype: int
    payload: object  # scalar, str, or (item type, [payloads])


@dataclass(frozen=True)
class Nested:
    """An array nested `depth` deep around two int32 items (written without recursion)."""

    depth: int


@dataclass
class Tensor:
    name: str
    dims: list[int]
    ttype: int
    offset: int


@dataclass
class Model:
    version: int
    metadata: list[tuple[str, Value]]
    tensors: list[Tensor]
    data: bytes  # everything after the aligned end of the tensor infos
    alignment: int = 32
    extra_header: dict = field(default_factory=dict)  # count overrides

    def get(self, key: str) -> Value | None:
        return next((v for k, v in self.metadata if k == key), None)

    def set(self, key: str, value: Value) -> None:
        for i, (k, _) in enumerate(self.metadata):
            if k == key:
                self.metadata[i] = (key, value)
                return
        self.metadata.append((key, value))


# -- reading and writing ------------------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, code: str):
        (v,) = struct.unpack_from("<" + code, self.data, self.pos)
        self.pos += struct.calcsize("<" + code)
        return v

    def string(self) -> str:
        n = self.take("Q")
        s = self.data[self.pos : self.pos + n].decode("utf-8", "surrogateescape")
        self.pos += n
        return s

    def payload(self, vtype: int):
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == STRING:
            return self.string()
        itype, n = self.take("I"), self.take("Q")
        return (itype, [self.payload(itype) for _ in range(n)])


def parse(data: bytes) -> Model:
    r = _Reader(data)
    assert r.data[:4] == b"GGUF"
    r.pos = 4
    version, n_tensors, n_kv = r.take("I"), r.take("Q"), r.take("Q")
    metadata = []
    for _ in range(n_kv):
        key = r.string()
        vtype = r.take("I")
        metadata.append((key, Value(vtype, r.payload(vtype))))
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.take("Q") for _ in range(r.take("I"))]
        tensors.append(Tensor(name, dims, r.take("I"), r.take("Q")))
    alignment = next((v.payload for k, v in metadata if k == "general.alignment"), 32)
    start = -(-r.pos // alignment) * alignment
    return Model(version, metadata, tensors, data[start:], alignment)


def _pack_payload(vtype: int, payload, out: list) -> None:
    if isinstance(payload, Nested):
        out.append(struct.pack("<IQ", ARRAY, 1) * (payload.depth - 1))
        out.append(struct.pack("<IQii", 5, 2, 1, 2))
    elif vtype in _SCALAR:
        out.append(struct.pack("<" + _SCALAR[vtype], payload))
    elif vtype == STRING:
        raw = payload.encode("utf-8", "surrogateescape")
        out.append(struct.pack("<Q", len(raw)) + raw)
    else:
        itype, items = payload
        out.append(struct.pack("<IQ", itype, len(items)))
        for item in items:
            _pack_payload(itype, item, out)


def serialize(m: Model) -> bytes:
    out = [b"GGUF", struct.pack("<I", m.version)]
    out.append(struct.pack("<Q", m.extra_header.get("n_tensors", len(m.tensors))))
    out.append(struct.pack("<Q", m.extra_header.get("n_kv", len(m.metadata))))
    for key, value in m.metadata:
        _pack_payload(STRING, key, out)
        out.append(struct.pack("<I", value.vtype))
        _pack_payload(value.vtype, value.payload, out)
    for t in m.tensors:
        _pack_payload(STRING, t.name, out)
        out.append(struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims))
        out.append(struct.pack("<IQ", t.ttype, t.offset))
    head = b"".join(out)
    head += b"\0" * (-len(head) % m.alignment)
    return head + m.data


# -- mutations ------------------------------------------------------------------------------------

HOSTILE_TEMPLATES = [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}",
    "{{ 'x' * 1000000000 }}",
    "{{ range(10**9) | list }}",
    "{{ 1 / 0 }}",
    "{{ messages | sum }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}",
    "{% for %}",
    "{{ raise_exception('refused') }}",
    "{{ messages | tojson(indent=1000000000) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ 'x'.center(999999999) }}",
    "{{ ('x' * 99999) | replace('x', 'y' * 99999) }}",
    "{{ 9 ** 99999 }}",
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ ('y' * 99999).join('x' * 99999) }}",
    "{{ messages[0]['content'][999] }}",
    "{{ undefined_thing.attr }}",
    "{{ cycler }}{{ joiner() }}{{ lipsum(999999) }}",
]


def _pick(rng: np.random.Generator, options):
    """One of the options, kept as it is (rng.choice would turn big ints into floats)."""
    options = list(options)
    return options[int(rng.integers(0, len(options)))]


def _random_value(rng: np.random.Generator, depth: int = 0) -> Value:
    """A value of a random kind, often an absurd one."""
    kind = int(rng.integers(0, 9))
    if kind == 0:
        return Value(STRING, _pick(rng, ["", "x", "linear", "gpt2", "llama", "\udcff", "9" * 50]))
    if kind == 1:
        vtype = int(_pick(rng, _INT_TYPES))
        bits = struct.calcsize(_SCALAR[vtype]) * 8
        signed = _SCALAR[vtype].islower()
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        choice = [lo, hi, 0, 1, 2, -1 if signed else 3, 7, 31, 33, 1 << min(bits - 2, 40)]
        return Value(vtype, int(_pick(rng, [c for c in choice if lo <= c <= hi])))
    if kind == 2:
        v = float(_pick(rng, [np.inf, -np.inf, np.nan, 0.0, -1.0, 1e-30, 1e30, 0.5, 3.4e38]))
        return Value(int(_pick(rng, [6, 12])), v)
    if kind == 3:
        return Value(7, bool(rng.integers(0, 2)))
    if kind == 4:  # array of ints
        n = int(_pick(rng, [0, 1, 3, 300]))
        return Value(ARRAY, (5, [int(x) for x in rng.integers(-5, 10, n)]))
    if kind == 5:  # array of strings
        return Value(ARRAY, (STRING, ["a", "b c", ""][: int(rng.integers(0, 4))]))
    if kind == 6:  # array of floats
        return Value(ARRAY, (6, [float(x) for x in rng.standard_normal(int(rng.integers(0, 5)))]))
    if kind == 7 and depth == 0:  # nested arrays, deep
        return Value(ARRAY, Nested(int(_pick(rng, [2, 50, 2000]))))
    return Value(STRING, "x" * int(_pick(rng, [1, 1000, 70000])))


def _mutate_metadata_type(m: Model, rng) -> str:
    key, _ = m.metadata[int(rng.integers(0, len(m.metadata)))]
    if key == "general.alignment":
        return "skip"
    m.set(key, _random_value(rng))
    return f"type:{key}"


def _mutate_metadata_value(m: Model, rng) -> str:
    numeric = [(k, v) for k, v in m.metadata if v.vtype in _SCALAR and v.vtype != 7]
    key, value = numeric[int(rng.integers(0, len(numeric)))]
    if key == "general.alignment":
        return "skip"
    old = value.payload
    options = [0, 1, -1, 2, old + 1, old - 1, old * 2, old // 2 if value.vtype != 6 else old / 2]
    options += [1 << 31, 1 << 40, 3, 7]
    new = options[int(rng.integers(0, len(options)))]
    if value.vtype == 6 or value.vtype == 12:
        new = float(_pick(rng, [0.0, -1.0, float("inf"), float("nan"), 1e-12, 1e12, float(new)]))
    else:
        vtype = 11 if new < 0 or new >= 1 << 32 else 4
        value = Value(vtype, int(new))
        m.set(key, value)
        return f"value:{key}={new}"
    m.set(key, Value(value.vtype, new))
    return f"value:{key}={new}"


def _mutate_delete_key(m: Model, rng) -> str:
    i = int(rng.integers(0, len(m.metadata)))
    key = m.metadata[i][0]
    if key == "general.alignment":
        return "skip"
    del m.metadata[i]
    return f"delete:{key}"


def _mutate_tensor(m: Model, rng) -> str:
    t = m.tensors[int(rng.integers(0, len(m.tensors)))]
    kind = int(rng.integers(0, 6))
    if kind == 0:
        t.ttype = int(_pick(rng, _TENSOR_TYPES))
        return f"tensor-type:{t.name}={t.ttype}"
    if kind == 1:
        t.dims = list(reversed(t.dims))
        return f"tensor-swap:{t.name}"
    if kind == 2:
        t.dims[int(rng.integers(0, len(t.dims)))] //= int(_pick(rng, [2, 8, 32]))
        t.dims = [max(d, 1) for d in t.dims]
        return f"tensor-shrink:{t.name}={t.dims}"
    if kind == 3:
        t.dims = t.dims + [int(_pick(rng, [1, 2]))]
        return f"tensor-dim:{t.name}={t.dims}"
    if kind == 4:
        other = m.tensors[int(rng.integers(0, len(m.tensors)))]
        t.offset = other.offset
        return f"tensor-offset:{t.name}"
    m.tensors.remove(t)
    return f"tensor-drop:{t.name}"


def _mutate_vector(m: Model, rng) -> str:
    vectors = [t for t in m.tensors if len(t.dims) == 1]
    t = vectors[int(rng.integers(0, len(vectors)))]
    t.dims = [int(_pick(rng, [1, 32, t.dims[0] // 2, t.dims[0] - 32]))]
    if t.dims[0] < 1:
        t.dims = [1]
    if rng.random() < 0.3:  # every norm at once
        for other in vectors:
            other.dims = list(t.dims)
    return f"vector:{t.name}={t.dims}"


def _mutate_tokenizer(m: Model, rng) -> str:
    kind = int(rng.integers(0, 9))
    tokens = m.get("tokenizer.ggml.tokens")
    merges = m.get("tokenizer.ggml.merges")
    types = m.get("tokenizer.ggml.token_type")
    if kind == 0 and tokens:  # flip a bit of one token
        items = list(tokens.payload[1])
        i = int(rng.integers(0, len(items)))
        raw = bytearray(items[i].encode("utf-8", "surrogateescape") or b"a")
        raw[int(rng.integers(0, len(raw)))] ^= 1 << int(rng.integers(0, 8))
        items[i] = raw.decode("utf-8", "surrogateescape")
        m.set("tokenizer.ggml.tokens", Value(ARRAY, (STRING, items)))
        return f"token-bit:{i}"
    if kind == 1 and tokens:  # drop the tail of the vocabulary
        items = tokens.payload[1][: int(rng.integers(0, len(tokens.payload[1])))]
        m.set("tokenizer.ggml.tokens", Value(ARRAY, (STRING, items)))
        return f"tokens-cut:{len(items)}"
    if kind == 2 and merges and merges.payload[1]:
        items = list(merges.payload[1])
        i = int(rng.integers(0, len(items)))
        items[i] = str(_pick(rng, ["", "nospace", "a b c", "zz qq", items[i][::-1], " "]))
        m.set("tokenizer.ggml.merges", Value(ARRAY, (STRING, items)))
        return f"merge:{i}={items[i]!r}"
    if kind == 3 and types:
        items = list(types.payload[1])
        i = int(rng.integers(0, len(items)))
        items[i] = int(_pick(rng, [0, 2, 3, 4, 5, 6, 7, -1, 1000]))
        m.set("tokenizer.ggml.token_type", Value(ARRAY, (types.payload[0], items)))
        return f"token-type:{i}={items[i]}"
    if kind == 4 and types:
        m.set("tokenizer.ggml.token_type", Value(ARRAY, (5, types.payload[1][:-3])))
        return "token-types-short"
    if kind == 5:
        key = str(_pick(rng, ["bos_token_id", "eos_token_id", "eot_token_id"]))
        v = int(_pick(rng, [-1, 300, 1 << 31, 1 << 32 - 1, 10**6]))
        m.set(f"tokenizer.ggml.{key}", Value(11 if v < 0 else 4, v))
        return f"special:{key}={v}"
    if kind == 6:
        m.set("tokenizer.ggml.model", Value(STRING, str(_pick(rng, ["llama", "bert", "", "gpt2"]))))
        return "tokenizer-model"
    if kind == 7:
        pre = str(_pick(rng, ["default", "llama-bpe", "qwen2", "unknown", ""]))
        m.set("tokenizer.ggml.pre", Value(STRING, pre))
        return f"pre:{pre}"
    if tokens:  # a byte-typed token that is not <0xHH>
        n = len(tokens.payload[1])
        items = list(tokens.payload[1])
        items[0] = "<0xZZ>"
        m.set("tokenizer.ggml.tokens", Value(ARRAY, (STRING, items)))
        m.set("tokenizer.ggml.token_type", Value(ARRAY, (5, [6] + [1] * (n - 1))))
        return "byte-token"
    return "skip"


def _mutate_template(m: Model, rng) -> str:
    if rng.random() < 0.2:
        m.set("tokenizer.chat_template", _random_value(rng))
        return "template-type"
    i = int(rng.integers(0, len(HOSTILE_TEMPLATES)))
    m.set("tokenizer.chat_template", Value(STRING, HOSTILE_TEMPLATES[i]))
    return f"template:{i}"


def _mutate_header(m: Model, rng) -> str:
    kind = int(rng.integers(0, 3))
    if kind == 0:
        m.version = int(_pick(rng, [0, 1, 2, 4, 1 << 31]))
        return f"version:{m.version}"
    key = "n_tensors" if kind == 1 else "n_kv"
    n = len(m.tensors) if kind == 1 else len(m.metadata)
    m.extra_header[key] = int(_pick(rng, [0, n - 1, n + 1, 1 << 40, (1 << 64) - 1]))
    return f"{key}:{m.extra_header[key]}"


MUTATIONS = {
    "header": _mutate_header,
    "metadata-type": _mutate_metadata_type,
    "metadata-value": _mutate_metadata_value,
    "delete-key": _mutate_delete_key,
    "tensor": _mutate_tensor,
    "vector": _mutate_vector,
    "tokenizer": _mutate_tokenizer,
    "template": _mutate_template,
}


def _flip_bytes(data: bytes, rng, header_end: int) -> bytes:
    out = bytearray(data)
    for _ in range(int(rng.integers(1, 6))):
        out[int(rng.integers(0, header_end))] = int(rng.integers(0, 256))
    return bytes(out)


def mutants(original: bytes, seed: int):
    """An endless stream of (description, file bytes), reproducible from the seed."""
    rng = np.random.default_rng(seed)
    base = parse(original)
    header_end = len(original) - len(base.data)
    names = list(MUTATIONS) + ["bytes", "truncate"]
    while True:
        kind = names[int(rng.integers(0, len(names)))]
        if kind == "bytes":
            yield "bytes", _flip_bytes(original, rng, header_end)
            continue
        if kind == "truncate":
            yield "truncate", original[: int(rng.integers(0, len(original)))]
            continue
        m = parse(original)
        what = [MUTATIONS[kind](m, rng) for _ in range(1 if rng.random() < 0.8 else 2)]
        if "skip" in what:
            continue
        yield ",".join(what), serialize(m)
