"""qwen3: Qwen3 (dense). Qwen2's block without the Q/K/V biases, with an RMSNorm of every Q
and K head before RoPE; NEOX RoPE."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fastrun.runner.models.base import Transformer, TransformerConfig


@dataclass(frozen=True)
class Qwen3Config(TransformerConfig):
    neox_rope = True

    def block(self):
        return replace(super().block(), qk_norm=True)


class Model(Transformer):
    config_class = Qwen3Config
