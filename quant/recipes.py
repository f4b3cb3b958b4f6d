"""Which type each tensor gets for a target file type: llama-quantize's choices, reproduced.

A file type ("Q4_K_M") names a default block format plus a recipe: the output (and a tied
token embedding) at Q6_K, more bits for some attn_v and ffn_down layers in the _M mixes, and a
fallback to a 32-block format where a row is not a whole number of 256-blocks. Norms, biases
and other 1-D tensors keep their type. The rules follow llama.cpp's src/llama-quant.cpp
(`llama_tensor_get_type`) for the file types fastrun writes; tensors are visited in
llama-quantize's order, which the layer counters of the mixes depend on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastrun.formats.errors import FastrunError
from fastrun.quant.formats import BlockFormat, block_format


@dataclass(frozen=True)
class FileType:
    name: str
    id: int  # llama_ftype, stored as general.file_type
    default: str  # the block format most tensors get


FILE_TYPES = {
    t.name: t
    for t in [
        FileType("F32", 0, "F32"),
        FileType("F16", 1, "F16"),
        FileType("BF16", 32, "BF16"),
        FileType("Q4_0", 2, "Q4_0"),
        FileType("Q4_1", 3, "Q4_1"),
        FileType("Q8_0", 7, "Q8_0"),
        FileType("Q5_0", 8, "Q5_0"),
        FileType("Q5_1", 9, "Q5_1"),
        FileType("Q4_K_S", 14, "Q4_K"),
        FileType("Q4_K_M", 15, "Q4_K"),
        FileType("Q5_K_S", 16, "Q5_K"),
        FileType("Q5_K_M", 17, "Q5_K"),
        FileType("Q6_K", 18, "Q6_K"),
    ]
}
ALIASES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # as llama-quantize reads them
_FLOAT = ("F32", "F16", "BF16")
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# Substrings of weight names that are never quantized (llama.cpp's tensor_allows_quantization,
# for the architectures fastrun knows and their common relatives).
_KEEP = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    *(
        f"time_mix_{part}.weight"  # RWKV's small 2-D weights
        for part in ("first w0 w1 w2 v0 v1 v2 a0 a1 a2 g1 g2 decay_w1 decay_w2 lerp_fused".split())
    ),
    "attn_rel_b.weight",
    ".position_embd",
    ".patch_embd",
)
_KEEP_EXACT = ("position_embd.weight", "token_types.weight")


def file_type(name: str) -> FileType:
    """The file type for a --type name (case-insensitive, Q4_K and Q5_K meaning their _M)."""
    key = name.upper()
    key = ALIASES.get(key, key)
    if key not in FILE_TYPES:
        known = ", ".join(list(FILE_TYPES) + list(ALIASES))
        raise FastrunError(f"unknown type {name!r} (known: {known})")
    return FILE_TYPES[key]


def llama_order(names) -> list[str]:
    """Tensor names in llama-quantize's order: non-block tensors, then by block, then by name."""

    def key(name: str):
        m = re.match(r"blk\.(\d+)\.", name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


def _n_dims(shape: tuple[int, ...]) -> int:
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return n


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    if _n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    return not any(s in name for s in _KEEP) and name not in _KEEP_EXACT


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (
        ("attn_qkv.weight", "attn_v"),  # fused QKV and MLA's kv_b count as attn_v
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return cat
    return "other"


def _more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers the _M mixes give more bits: the first and last eighth and every third."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


class TypeChooser:
    """Picks each tensor's type for one file; call `choose` in llama_order (it keeps counters).

    arch, n_layer and n_expert come from the file's metadata; is_70b is llama.cpp's model type
    "70B" (an 80-layer llama with grouped-query attention), whose attn_v gets more bits."""

    def __init__(
        self,
        ftype: FileType,
        names,
        arch: str,
        n_layer: int,
        n_expert: int = 0,
        is_70b: bool = False,
    ):
        self.ftype = ftype
        self.arch = arch
        self.n_layer = n_layer
        self.n_expert = max(1, n_expert)
        self.is_70b = is_70b
        cats = [_category(n) for n in names]
        self.n_attention_wv = cats.count("attn_v")
        self.tied_embeddings = "output" not in cats
        self.i_attention_wv = 0
        self.i_ffn_down = 0

    def choose(self, name: str, shape: tuple[int, ...], current: BlockFormat) -> BlockFormat:
        if not allows_quantization(name, shape):
            return current
        new = self.ftype.default
        if new not in _FLOAT:
            new = self._mix(name, shape, new)
            new = _fallback(shape[0], new)
        return block_format(new)

    def _layer(self, counter: int, name: str) -> int:
        if self.n_expert > 1:  # experts are not consecutive: read the layer from the name
            m = re.match(r"blk\.(\d+)\.", name)
            if m is None or not 0 <= int(m.group(1)) < self.n_layer:
                raise FastrunError(f"cannot tell the layer of tensor {name}")
            return int(m.group(1))
        return counter

    def _mix(self, name: str, shape: tuple[int, ...], new: str) -> str:
        ft, cat = self.ftype.name, _category(name)
        falcon = self.arch == "falcon"
        if cat == "output" or (self.tied_embeddings and cat == "token_embd"):
            if falcon or shape[0] % block_format(new).block_size:
                return "Q8_0"
            return new if new == "Q8_0" else "Q6_K"
        if cat == "attn_v":
            if ft in ("Q4_K_M", "Q5_K_M") and _more_bits(self.i_attention_wv, self.n_attention_wv):
                new = "Q6_K"
            elif ft == "Q4_K_S" and self.i_attention_wv < 4:
                new = "Q5_K"
            if self.is_70b and new == "Q4_K":
                new = "Q5_K"
            if self.n_expert == 8:
                new = "Q8_0"
            self.i_attention_wv += 1
        elif cat == "attn_k":
            if self.n_expert == 8:
                new = "Q8_0"
        elif cat == "ffn_down":
            i = self._layer(self.i_ffn_down, name)
            n = self.n_layer
            if ft == "Q4_K_M":
                if falcon:
                    new = "Q6_K" if i < n // 16 else "Q5_K" if _more_bits(i, n) else "Q4_K"
                elif _more_bits(i, n):
                    new = "Q6_K"
            elif ft == "Q5_K_M" and _more_bits(i, n):
                new = "Q6_K"
            elif ft == "Q4_K_S" and not falcon and i < n // 8:
                new = "Q5_K"
            self.i_ffn_down += 1
        elif cat == "attn_output":
            if not falcon and self.n_expert == 8 and ft in ("Q4_K_S", "Q4_K_M"):
                new = "Q5_K"
        return new


def _fallback(n_cols: int, qtype: str) -> str:
    """A type whose blocks fit a row of n_cols: K-quants step down to 32-blocks, then F16."""
    if n_cols % block_format(qtype).block_size == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if n_cols % block_format(qtype).block_size == 0 else "F16"
