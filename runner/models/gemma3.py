"""gemma3: Gemma 3. Five sliding-window layers to one global (the pattern and window from the
metadata), each kind with its own RoPE base; Q/K head norms; norms before and after attention
and the FFN; GELU (tanh) gating; embeddings scaled by sqrt(n_embd); NEOX RoPE. The GGUF
converter already adds Gemma's 1 to every norm weight, so they are plain RMSNorms here."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fastrun.backends.block import GELU_TANH, BlockSpec, LayerAttention
from fastrun.formats import keys
from fastrun.runner.models.base import Transformer, TransformerConfig

LOCAL_ROPE_BASE = 10000.0  # llama.cpp's default for gemma3 files that do not state it


def window_layers(n_layer: int, pattern: int) -> list[bool]:
    """Which layers attend through the sliding window: all but every pattern-th (llama.cpp's
    set_swa_pattern; pattern 0 or 1 would mean none global or all global)."""
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layer)]


@dataclass(frozen=True)
class Gemma3Config(TransformerConfig):
    sliding_window: int = 0  # positions a local layer sees; 0: every layer is global
    window_pattern: int = 6  # every pattern-th layer is global
    local_rope_base: float = LOCAL_ROPE_BASE
    final_softcap: float = 0.0

    neox_rope = True
    default_pattern = 6

    @classmethod
    def arch_fields(cls, f, common):
        return dict(
            sliding_window=f.get(keys.SLIDING_WINDOW) or 0,
            window_pattern=f.get(keys.SLIDING_WINDOW_PATTERN) or cls.default_pattern,
            local_rope_base=f.get(keys.ROPE_FREQ_BASE_SWA) or cls.local_rope_base_default(common),
            final_softcap=f.get(keys.FINAL_SOFTCAP) or 0.0,
        )

    @classmethod
    def local_rope_base_default(cls, common: dict) -> float:
        return LOCAL_ROPE_BASE

    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """Global layers take the file's RoPE; local ones their base, without its scaling."""
        local = replace(self.rope, freq_base=self.local_rope_base, freq_scale=1.0)
        glob = LayerAttention(rope=self.rope)
        windowed = LayerAttention(rope=local, window=self.sliding_window)
        if not self.sliding_window:
            return tuple(glob for _ in range(self.n_layer))
        pattern = window_layers(self.n_layer, self.window_pattern)
        return tuple(windowed if w else glob for w in pattern)

    def block(self) -> BlockSpec:
        return BlockSpec(
            layers=self.layer_attention(),
            # as llama.cpp's f_attention_scale: a float32 square root and division
            attn_scale=float(np.float32(1) / np.sqrt(np.float32(self.head_dim))),
            scale_q=True,
            activation=GELU_TANH,
            qk_norm=True,
            post_norms=True,
            embed_scale=float(np.sqrt(np.float32(self.n_embd))),
            final_softcap=self.final_softcap,
        )


class Model(Transformer):
    config_class = Gemma3Config
