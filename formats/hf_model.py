"""A Hugging Face model folder read as the GGUF file convert_hf_to_gguf.py would make of it.

`HFModel` offers what the quantize pipeline reads from a GGUFFile (architecture, metadata,
tensor table, raw tensor rows) for a folder with config.json, *.safetensors and a tokenizer:
- GGUF tensor names (model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight), in the
  converter's order, with the rows of llama's attn_q and attn_k permuted back from
  Hugging Face's rotary layout to the interleaved one GGUF models use;
- each tensor in its stored float type, except 1-D tensors and norms, which the converter
  always writes as F32 (and so they are offered as F32);
- metadata: the converter's keys for the architecture's hyperparameters, general.name and
  general.size_label, sampling defaults from generation_config.json, and the tokenizer
  (formats/hf_tokenizer.py).
Not derived: what the converter guesses from a model card (README.md: license, tags,
datasets) or from the folder's name beyond general.name (basename, finetune, version).

config.json is untrusted: every value read is type- and range-checked into one error line.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from fastrun.formats import keys
from fastrun.formats.errors import FastrunError, GGUFError, shown
from fastrun.formats.gguf import TensorInfo
from fastrun.formats.hf_tokenizer import HFTokenizer, load_json
from fastrun.formats.safetensors_folder import SafetensorsFolder
from fastrun.formats.writer import FLOAT32, INT32, STRING, UINT32, MetadataValue
from fastrun.quant.float_types import float_values
from fastrun.quant.formats import block_format

# config.json "architectures" -> GGUF architecture, for those fastrun runs.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
# The file types the converter writes itself (--outtype); others come from llama-quantize.
CONVERTER_FILE_TYPES = ("F32", "F16", "BF16", "Q8_0")
_FLOAT_DTYPES = ("F32", "F16", "BF16")
_MAX_INT = 1 << 31
_SCALES = ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M"))  # size-label suffixes

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": keys.TOKEN_EMBD,
    "model.norm.weight": keys.OUTPUT_NORM,
    "lm_head.weight": keys.OUTPUT,
}
_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# Buffers some checkpoints carry that no GGUF needs (the converter drops them too).
_SKIPPED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
# generation_config.json -> general.sampling.*, with the GGUF type of each.
_SAMPLING = {
    "top_k": ("general.sampling.top_k", INT32),
    "top_p": ("general.sampling.top_p", FLOAT32),
    "min_p": ("general.sampling.min_p", FLOAT32),
    "temperature": ("general.sampling.temp", FLOAT32),
    "repetition_penalty": ("general.sampling.penalty_repeat", FLOAT32),
}


def is_hf_folder(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def gguf_name(hf_name: str) -> str | None:
    """The GGUF tensor name of a Hugging Face one; None for tensors a GGUF drops."""
    if hf_name.endswith(_SKIPPED_SUFFIXES):
        return None
    name = hf_name.replace("language_model.", "")
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_NAME.fullmatch(name)
    if m and m.group(2) in _LAYER_PARTS:
        return f"blk.{int(m.group(1))}.{_LAYER_PARTS[m.group(2)]}.{m.group(3)}"
    raise FastrunError(f"cannot map tensor {shown(hf_name)} to a GGUF name")


def rotary_row_order(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that turns Hugging Face's q/k layout (each head's rotary halves one after the
    other) into GGUF's (the two halves interleaved): new row k is old row order[k]."""
    half = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(-1)


def id_to_title(name: str) -> str:
    """general.name from a model id, as the converter titles it: lower-case words
    capitalised, acronyms and version numbers as they are."""
    words = name.strip().replace("-", " ").split()
    version = re.compile(r"^(v\d+(?:\.\d+)*|\d.*)$")
    return " ".join(w.title() if w.islower() and not version.match(w) else w for w in words)


def size_label(n_params: int) -> str:
    """The parameter count rounded as the converter writes general.size_label ("111K")."""
    scale, suffix = next(
        ((scale, suffix) for limit, scale, suffix in _SCALES if n_params > limit), (1e-3, "K")
    )
    scaled = n_params * scale
    digits = max(2 - len(str(round(scaled)).lstrip("0")), 0)
    return f"{scaled:.{digits}f}{suffix}"


class _Config:
    """config.json's values, checked as they are read."""

    def __init__(self, data: dict):
        if isinstance(data.get("text_config"), dict):  # multimodal wrappers: the text model
            data = {**data, **data["text_config"]}
        self.data = data

    def first(self, names: tuple[str, ...]):
        return next((self.data[n] for n in names if n in self.data), None)

    def int(self, *names: str, required: bool = True, low: int = 1) -> int | None:
        value = self.first(names)
        if value is None:
            if required:
                raise FastrunError(f"config.json has no {names[0]}")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < _MAX_INT:
            raise FastrunError(f"config.json: {names[0]} is {shown(repr(value))}")
        return value

    def float(self, value, name: str) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise FastrunError(f"config.json: {name} is {shown(repr(value))}")
        return float(value)


class HFModel:
    """A Hugging Face folder opened for conversion; use as a context manager or close()."""

    direct_file_types = CONVERTER_FILE_TYPES

    def __init__(self, folder: str | os.PathLike):
        self.path = os.fspath(folder)
        raw_config = load_json(self.path, "config.json", required=True)
        names = raw_config.get("architectures")
        hf_arch = names[0] if isinstance(names, list) and names else None
        if hf_arch not in ARCHITECTURES:
            raise FastrunError(
                f"config.json: architecture {shown(repr(hf_arch))} is not one fastrun converts "
                f"(known: {', '.join(ARCHITECTURES)})"
            )
        self._architecture = ARCHITECTURES[hf_arch]
        self.config = _Config(raw_config)
        if self.config.first(("num_local_experts", "num_experts", "n_routed_experts")):
            raise FastrunError("mixture-of-experts checkpoints are not supported")
        self.n_head = self.config.int("num_attention_heads", "n_head", "n_heads")
        self.n_head_kv = self.config.int("num_key_value_heads", "n_kv_heads", required=False)
        self.store = SafetensorsFolder(self.path)
        try:
            self._index_tensors()
            self._metadata = self._build_metadata(raw_config)
        except BaseException:
            self.store.close()
            raise

    # -- tensors ---------------------------------------------------------------------------

    def _index_tensors(self) -> None:
        self.tensors: dict[str, TensorInfo] = {}
        self._sources: dict[str, str] = {}  # GGUF name -> stored name
        for stored in self.store.tensors.values():
            name = gguf_name(stored.name)
            if name is None:
                continue
            if stored.dtype not in _FLOAT_DTYPES:
                raise FastrunError(
                    f"tensor {shown(stored.name)} is {stored.dtype}; fastrun converts "
                    "F32, F16 and BF16 checkpoints"
                )
            shape = tuple(reversed(stored.shape)) or (1,)  # GGUF order: fastest first
            if any(d <= 0 for d in shape) or len(shape) > 4:
                raise FastrunError(f"tensor {shown(stored.name)} has shape {list(stored.shape)}")
            # the converter writes 1-D tensors and norms as F32 whatever their stored type
            as_f32 = len(shape) == 1 or name.endswith("_norm.weight")
            fmt = block_format("F32" if as_f32 else stored.dtype)
            n = int(np.prod(shape, dtype=np.int64))
            self.tensors[name] = TensorInfo(name, fmt, shape, 0, n * fmt.block_bytes)
            self._sources[name] = stored.name
        self._extra: dict[str, np.ndarray] = {}
        rope_factors = self._llama3_rope_factors()
        if rope_factors is not None:
            self._extra[keys.ROPE_FREQS] = rope_factors
            fmt = block_format("F32")
            shape = (rope_factors.size,)
            self.tensors = {  # the converter generates it before the stored tensors
                keys.ROPE_FREQS: TensorInfo(keys.ROPE_FREQS, fmt, shape, 0, 4 * shape[0]),
                **self.tensors,
            }
        for name in (keys.TOKEN_EMBD,):
            if name not in self.tensors:
                raise FastrunError(f"{self.path}: no {name} (model.embed_tokens.weight)")

    def _row_order(self, name: str, n_rows: int) -> np.ndarray | None:
        """llama's q and k rows come permuted; None where rows stay as stored."""
        if self._architecture != "llama":
            return None
        if name.startswith("blk.") and ".attn_q." in name:
            n_head = self.n_head
        elif name.startswith("blk.") and ".attn_k." in name:
            n_head = self.n_head_kv or self.n_head
        else:
            return None
        if n_rows % (2 * n_head):
            raise FastrunError(f"{name}: {n_rows} rows do not split into {n_head} rotary heads")
        return rotary_row_order(n_rows, n_head)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A tensor's bytes in its offered type, as a uint8 [rows, row_bytes] array: a view of
        the file where the bytes are as stored, a copy where they are reordered or widened."""
        info = self.tensors[name]
        rows, cols = info.matrix_shape
        if name in self._extra:
            return self._extra[name].view(np.uint8).reshape(1, -1)
        stored = self.store.tensors[self._sources[name]]
        raw = self.store.raw(stored.name)
        order = self._row_order(name, rows if len(info.shape) > 1 else cols)
        if info.format.name == stored.dtype and order is None:
            return raw.reshape(rows, -1)
        values = float_values(raw, stored.dtype, widen=info.format.name == "F32")
        if order is not None:
            values = values.reshape(-1, cols)[order] if len(info.shape) > 1 else values[order]
        return np.ascontiguousarray(values).view(np.uint8).reshape(rows, -1)

    def _llama3_rope_factors(self) -> np.ndarray | None:
        """rope_freqs.weight for llama's "llama3" RoPE scaling, computed as the converter does."""
        rope = self._rope_parameters()
        if self._architecture != "llama" or str(rope.get("rope_type", "")).lower() != "llama3":
            return None
        c = self.config
        base = c.float(rope.get("rope_theta", 10000.0), "rope_theta")
        dim = c.int("head_dim", required=False) or c.int("hidden_size") // self.n_head
        factor = c.float(rope.get("factor", 8.0), "rope factor")
        low = c.float(rope.get("low_freq_factor", 1.0), "low_freq_factor")
        high = c.float(rope.get("high_freq_factor", 4.0), "high_freq_factor")
        old_ctx = c.float(rope.get("original_max_position_embeddings", 8192), "original context")
        freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        factors = []
        for freq in freqs.astype(np.float64):
            wavelen = 2 * math.pi / freq
            if wavelen < old_ctx / high:
                factors.append(1.0)
            elif wavelen > old_ctx / low:
                factors.append(factor)
            else:
                smooth = (old_ctx / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        return np.array(factors, dtype=np.float32)

    # -- metadata --------------------------------------------------------------------------

    def _rope_parameters(self) -> dict:
        c = self.config
        rope = c.data.get("rope_parameters", c.data.get("rope_scaling")) or {}
        if not isinstance(rope, dict):
            raise FastrunError("config.json: rope_parameters is not an object")
        rope = dict(rope.get("full_attention", rope))
        theta = c.first(("rope_theta", "rotary_emb_base"))
        if "rope_theta" not in rope and theta is not None:
            rope["rope_theta"] = theta
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
        return rope

    def _build_metadata(self, raw_config: dict) -> dict[str, MetadataValue]:
        arch, c = self._architecture, self.config
        meta: dict[str, MetadataValue] = {}

        def put(key: str, vtype: int, value) -> None:
            meta[key.format(arch=arch)] = MetadataValue(vtype, value)

        put(keys.ARCHITECTURE, STRING, arch)
        put("general.type", STRING, "model")
        model_id = raw_config.get("_name_or_path")
        if not (isinstance(model_id, str) and model_id and model_id.count("/") <= 1):
            model_id = os.path.basename(os.path.abspath(self.path))
        put(keys.NAME, STRING, id_to_title(model_id.split("/")[-1]))
        n_params = sum(t.n_elements for t in self.tensors.values())
        put("general.size_label", STRING, size_label(n_params))
        generation = load_json(self.path, "generation_config.json") or {}
        for field, (key, vtype) in _SAMPLING.items():
            value = generation.get(field)
            if value is not None:
                checked = c.float(value, f"generation_config.json {field}")
                put(key, vtype, int(checked) if vtype == INT32 else checked)

        n_layer = c.int("num_hidden_layers", "n_layers", "n_layer", "num_layers")
        put(keys.BLOCK_COUNT, UINT32, n_layer)
        ctx_names = ("max_position_embeddings", "n_ctx", "n_positions", "max_length")
        n_ctx = c.int(*ctx_names, "max_sequence_length", "model_max_length", required=False)
        if n_ctx is not None:
            put(keys.CONTEXT_LENGTH, UINT32, n_ctx)
        n_embd = c.int("hidden_size", "n_embd", "dim")
        put(keys.EMBEDDING_LENGTH, UINT32, n_embd)
        ff_names = ("intermediate_size", "n_inner", "hidden_dim")
        n_ff = c.int("prefix_dense_intermediate_size", "dense_intermediate_size", *ff_names)
        put(keys.FEED_FORWARD_LENGTH, UINT32, n_ff)
        put(keys.HEAD_COUNT, UINT32, self.n_head)
        if self.n_head_kv is not None:
            put(keys.HEAD_COUNT_KV, UINT32, self.n_head_kv)
        self._rope_metadata(put)
        eps = c.first(("rms_norm_eps", "norm_eps"))
        if eps is not None:
            put(keys.RMS_EPS, FLOAT32, c.float(eps, "rms_norm_eps"))
        head_dim = c.int("head_dim", required=False)
        if head_dim is not None:
            put(keys.KEY_LENGTH, UINT32, head_dim)
            put(keys.VALUE_LENGTH, UINT32, head_dim)
        if arch == "llama":
            put(keys.VOCAB_SIZE, UINT32, c.int("vocab_size"))
            put(keys.ROPE_DIMENSION_COUNT, UINT32, head_dim or n_embd // self.n_head)
        vocab_size = c.int("vocab_size", required=False)
        if vocab_size is None:
            vocab_size = self.tensors[keys.TOKEN_EMBD].shape[1]
        tokenizer = HFTokenizer(self.path, c.data)
        meta.update(tokenizer.metadata(vocab_size, arch))
        return meta

    def _rope_metadata(self, put) -> None:
        c, rope = self.config, self._rope_parameters()
        rope_type = rope.get("rope_type")
        factor = rope.get("factor")
        if rope_type == "linear" and factor is not None:
            put(keys.ROPE_SCALING_TYPE, STRING, "linear")
            put(keys.ROPE_SCALING_FACTOR, FLOAT32, c.float(factor, "rope factor"))
        elif rope_type == "yarn" and factor is not None:
            put(keys.ROPE_SCALING_TYPE, STRING, "yarn")
            put(keys.ROPE_SCALING_FACTOR, FLOAT32, c.float(factor, "rope factor"))
            original = rope.get("original_max_position_embeddings")
            if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
                raise FastrunError("config.json: yarn needs original_max_position_embeddings")
            put("{arch}.rope.scaling.original_context_length", UINT32, original)
            for field, key in (
                ("extrapolation_factor", "yarn_ext_factor"),
                ("attention_factor", "yarn_attn_factor"),
                ("beta_fast", "yarn_beta_fast"),
                ("beta_slow", "yarn_beta_slow"),
            ):
                if rope.get(field) is not None:
                    put(f"{{arch}}.rope.scaling.{key}", FLOAT32, c.float(rope[field], field))
        elif rope_type not in (None, "default", "llama3", "dynamic"):
            raise FastrunError(f"config.json: RoPE type {shown(repr(rope_type))} is not supported")
        theta = rope.get("rope_theta")
        if theta is not None:
            put(keys.ROPE_FREQ_BASE, FLOAT32, c.float(theta, "rope_theta"))

    # -- the GGUFFile surface the pipeline reads -------------------------------------------

    @property
    def architecture(self) -> str:
        return self._architecture

    def get(self, key: str, default=None):
        value = self._metadata.get(key.format(arch=self._architecture))
        return default if value is None else value.value

    def metadata_values(self) -> dict[str, MetadataValue]:
        return dict(self._metadata)

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: missing tensor {name}")
        return self.tensors[name]

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> HFModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
