"""llama: Llama 2/3, TinyLlama, SmolLM2. RoPE rotates adjacent pairs (the GGUF converter
permutes Q and K for that); the output weight may be tied to the token embedding."""

from __future__ import annotations

from dataclasses import dataclass

from fastrun.runner.models.base import Transformer, TransformerConfig


@dataclass(frozen=True)
class LlamaConfig(TransformerConfig):
    neox_rope = False


class Model(Transformer):
    config_class = LlamaConfig
