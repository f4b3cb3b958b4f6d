"""phi3: Phi-3 and Phi-3.5 (dense). The llama block with Q, K and V stored as one matrix
(attn_qkv) and gate and up as one (ffn_up, gate first), split into views at load; NEOX RoPE.
LongRoPE files (the 128k models) carry per-frequency divisors for contexts within the
original training length (rope_factors_short) and beyond it (rope_factors_long), and a
scale of cos and sin (rope.scaling.attn_factor); fastrun takes the short ones, as llama.cpp
does for a context within the original length, and folds the cos/sin scale, which multiplies
both q and k, into the attention scale as its square."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from fastrun.formats import keys
from fastrun.formats.errors import FastrunError
from fastrun.runner.models.base import Transformer, TransformerConfig


@dataclass(frozen=True)
class Phi3Config(TransformerConfig):
    rope_attn_factor: float = 1.0  # LongRoPE's scale of cos and sin

    neox_rope = True

    @classmethod
    def arch_fields(cls, f, common):
        factors = None
        if keys.ROPE_FACTORS_SHORT in f.tensors:
            n = common["rope"].n_dims // 2
            info = f.tensor(keys.ROPE_FACTORS_SHORT)
            if info.format.name != "F32" or info.shape != (n,):
                raise FastrunError(
                    f"{os.path.basename(f.path)}: {keys.ROPE_FACTORS_SHORT} is "
                    f"{info.format.name} {list(info.shape)}, expected F32 [{n}]"
                )
            raw = f.tensor_bytes(keys.ROPE_FACTORS_SHORT).tobytes()
            factors = np.frombuffer(raw, np.float32)
        common["rope"] = replace(common["rope"], freq_factors=factors)
        return dict(rope_attn_factor=f.get(keys.ROPE_ATTN_FACTOR) or 1.0)

    def block(self):
        spec = super().block()
        return replace(
            spec,
            fused_qkv=True,
            fused_gate_up=True,
            attn_scale=spec.attn_scale * self.rope_attn_factor**2,
        )


class Model(Transformer):
    config_class = Phi3Config
