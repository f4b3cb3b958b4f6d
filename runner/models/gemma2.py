"""gemma2: Gemma 2. Local (sliding-window) and global layers alternate, the first local;
attention scores and final logits are soft-capped (tanh); norms before and after attention
and the FFN, GELU (tanh) gating, embeddings scaled by sqrt(n_embd) as gemma3, without its
Q/K norms. Local layers share the global RoPE base unless the file states its own."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fastrun.formats import keys
from fastrun.runner.models.base import Transformer
from fastrun.runner.models.gemma3 import Gemma3Config

DEFAULT_WINDOW = 4096  # llama.cpp's for gemma2 files that do not state one
N_LAYER_27B = 46  # Gemma 2 27B scales queries by its n_embd / n_head, not its head size


@dataclass(frozen=True)
class Gemma2Config(Gemma3Config):
    attn_softcap: float = 0.0

    default_pattern = 2

    @classmethod
    def arch_fields(cls, f, common):
        fields = super().arch_fields(f, common)
        fields["sliding_window"] = f.get(keys.SLIDING_WINDOW) or DEFAULT_WINDOW
        fields["attn_softcap"] = f.get(keys.ATTN_SOFTCAP) or 0.0
        return fields

    @classmethod
    def local_rope_base_default(cls, common):
        return common["rope"].freq_base

    def block(self):
        query_scale = self.head_dim
        if self.n_layer == N_LAYER_27B:
            query_scale = self.n_embd // self.n_head
        return replace(
            super().block(),
            qk_norm=False,
            attn_softcap=self.attn_softcap,
            attn_scale=float(np.float32(1) / np.sqrt(np.float32(query_scale))),
        )


class Model(Transformer):
    config_class = Gemma2Config
