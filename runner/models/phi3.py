"""phi3: Phi-3 and Phi-3.5 (dense). The llama block with Q, K and V stored as one matrix
(attn_qkv) and gate and up as one (ffn_up, gate first), split into views at load; NEOX RoPE.
LongRoPE files (the 128k models) carry per-frequency divisors for contexts within the
original training length (rope_factors_short) and beyond it (rope_factors_long), and a
scale of cos and sin (rope.scaling.attn_factor). As llama.cpp does, a context of more tokens
per sequence than rope.scaling.original_context_length takes the long ones, any other the
short ones (for_context); the cos/sin scale, which multiplies both q and k, is folded into
the attention scale as its square."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from fastrun.backends.base import RopeConfig
from fastrun.formats import keys
from fastrun.runner.models.base import Transformer, TransformerConfig, rope_factors


@dataclass(frozen=True)
class Phi3Config(TransformerConfig):
    rope_attn_factor: float = 1.0  # LongRoPE's scale of cos and sin
    n_ctx_orig: int = 0  # the original training context; longer ones take rope_long
    rope_long: RopeConfig | None = None  # None: the file has no long factors

    neox_rope = True

    @classmethod
    def arch_fields(cls, f, common):
        rope = common["rope"]
        short = rope_factors(f, keys.ROPE_FACTORS_SHORT, rope.n_dims)
        long = rope_factors(f, keys.ROPE_FACTORS_LONG, rope.n_dims)
        common["rope"] = replace(rope, freq_factors=short)
        return dict(
            rope_attn_factor=f.get(keys.ROPE_ATTN_FACTOR) or 1.0,
            n_ctx_orig=f.get(keys.ROPE_ORIG_CONTEXT) or common["n_ctx_train"],
            rope_long=None if long is None else replace(rope, freq_factors=long),
        )

    def for_context(self, n_ctx):
        if self.rope_long is None or n_ctx <= self.n_ctx_orig:
            return self
        return self._long_context

    @cached_property
    def _long_context(self) -> Phi3Config:
        """One object, so that the model builds the long context's block once."""
        return replace(self, rope=self.rope_long, rope_long=None)

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
