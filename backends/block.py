"""A transformer block described as data: what an architecture file (runner/models) declares,
and what the Python forward pass (runner/models/base.py), the CPU's compiled stack and the
CUDA backend follow. It sits beside the Backend contract because it is part of it.

Every block has the same skeleton, the one of llama:

    x += attention_out( attention( rope( qk_norm( qkv( rms_norm(x) ) ) ) ) )   [post-norm]
    x += ffn_down( act(gate(rms_norm(x))) * up(rms_norm(x)) )                 [post-norm]

and a description names what varies between architectures: the gate's activation, an RMSNorm
of each Q and K head, an RMSNorm of each branch's output before its residual add, the
attention scores' soft-cap, and per layer the attention window and RoPE. A backend says which
of these features it runs (Backend.features); a model asking for one it lacks is refused with
one line before any weight is loaded, never run with the feature skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastrun.backends.base import RopeConfig
from fastrun.formats.errors import FastrunError

SILU, GELU_TANH = "silu", "gelu_tanh"  # gate activations

# Feature names, as Backend.features lists them and the refusal line spells them.
GELU = "GELU (tanh) gating"
QK_NORM = "Q/K head norms"
POST_NORMS = "post-attention and post-FFN norms"
WINDOW = "sliding-window attention"
ATTN_SOFTCAP = "attention soft-capping"
FINAL_SOFTCAP = "final logit soft-capping"
EMBED_SCALE = "scaled embeddings"
FEATURES = (GELU, QK_NORM, POST_NORMS, WINDOW, ATTN_SOFTCAP, FINAL_SOFTCAP, EMBED_SCALE)


@dataclass(frozen=True)
class LayerAttention:
    """What differs between the layers of one model."""

    rope: RopeConfig
    window: int = 0  # a query at position p sees positions p - window + 1 .. p; 0: all before


@dataclass(frozen=True)
class BlockSpec:
    """One architecture's transformer block, and the few model-wide steps around the blocks."""

    layers: tuple[LayerAttention, ...]  # one per block
    attn_scale: float  # multiplies q . k
    # attn_scale multiplies q (float32, after RoPE) before attention rounds it to fp16, not
    # the scores: llama.cpp's graph for gemma2 and gemma3 (ggml_scale on Q, kq_scale 1)
    scale_q: bool = False
    activation: str = SILU  # of the FFN gate
    qk_norm: bool = False  # RMSNorm of every Q and K head ([hd] weights) before RoPE
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs before their add
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap); 0: none
    embed_scale: float = 1.0  # token embeddings are multiplied by this
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap); 0: none
    fused_qkv: bool = False  # Q, K, V stored as one matrix (phi3): split into views at load
    fused_gate_up: bool = False  # gate and up stored as one matrix ffn_up (phi3), gate first

    def __post_init__(self):
        if self.activation not in (SILU, GELU_TANH):
            raise ValueError(f"unknown activation {self.activation!r}")

    @property
    def plain(self) -> bool:
        """The llama block (the fast paths of every backend were written for it)."""
        return not self.features()

    def features(self) -> set[str]:
        """The features beyond the llama block that this block needs."""
        wanted = {
            GELU: self.activation == GELU_TANH,
            QK_NORM: self.qk_norm,
            POST_NORMS: self.post_norms,
            WINDOW: any(layer.window for layer in self.layers),
            ATTN_SOFTCAP: self.attn_softcap > 0,
            FINAL_SOFTCAP: self.final_softcap > 0,
            EMBED_SCALE: self.embed_scale != 1.0,
        }
        return {name for name, needed in wanted.items() if needed}

    def check_backend(self, backend, arch: str) -> None:
        """One clear error when the backend lacks a feature this block needs."""
        missing = sorted(self.features() - set(backend.features))
        if missing:
            raise FastrunError(
                f"the {backend.name} backend cannot run {arch} models yet: no {', '.join(missing)}"
                " (try --backend cpu)"
            )
