"""qwen2: Qwen2 and Qwen2.5. Like llama, plus biases on Q, K and V (loaded by the shared
layer when present) and NEOX RoPE, which rotates the two halves of each head."""

from __future__ import annotations

from dataclasses import dataclass

from fastrun.runner.models.base import Transformer, TransformerConfig


@dataclass(frozen=True)
class Qwen2Config(TransformerConfig):
    neox_rope = True


class Model(Transformer):
    config_class = Qwen2Config
