"""Sandwich layers (Ouro / LoopLM): a norm on each sublayer's output before the residual add.

MCore's ``TransformerLayer`` normalises only a sublayer's input. The post-sublayer norms come by
spec: ``SandwichSelfAttention`` / ``SandwichMLP`` are the looped self-attention and MCore's MLP
with one more norm submodule (``post_layernorm``) applied to their output, so the layer computes

    x = x + post_attn_norm(attention(input_layernorm(x)))
    x = x + post_mlp_norm(mlp(pre_mlp_layernorm(x)))

with MCore's own bias-dropout-add doing the residual adds. Both need bias-free linear layers
(a bias would be added after the norm by MCore's bias-dropout-add).
"""

from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import sharded_state_dict_default

from .attention import LoopedSelfAttention


@dataclass
class SandwichSelfAttentionSubmodules(SelfAttentionSubmodules):
    """``SelfAttentionSubmodules`` with the norm of the attention output."""

    post_layernorm: Union[ModuleSpec, type] = None
    """Norm applied to the attention output (after ``linear_proj``), before the residual add."""


@dataclass
class SandwichMLPSubmodules(MLPSubmodules):
    """``MLPSubmodules`` with the norm of the MLP output."""

    post_layernorm: Union[ModuleSpec, type] = None
    """Norm applied to the MLP output (after ``linear_fc2``), before the residual add."""


def _post_norm(module, submodules, config):
    module.post_layernorm = build_module(submodules.post_layernorm, config=config,
                                         hidden_size=config.hidden_size,
                                         eps=config.layernorm_epsilon)


def _normed(module, output_with_bias, what: str) -> tuple:
    output, bias = output_with_bias
    if bias is not None:
        raise ValueError(f"sandwich {what}: a linear bias cannot follow the output norm "
                         f"(add_bias_linear must be False)")
    return module.post_layernorm(output), None


class SandwichSelfAttention(LoopedSelfAttention):
    """``LoopedSelfAttention`` whose output is normalised (``post_layernorm``)."""

    def __init__(self, config, submodules: SandwichSelfAttentionSubmodules, **kwargs):
        super().__init__(config=config, submodules=submodules, **kwargs)
        _post_norm(self, submodules, config)

    def forward(self, hidden_states, *args, **kwargs):
        return _normed(self, super().forward(hidden_states, *args, **kwargs), "attention")


class SandwichMLP(MLP):
    """MCore's ``MLP`` whose output is normalised (``post_layernorm``)."""

    def __init__(self, config, submodules: SandwichMLPSubmodules, **kwargs):
        super().__init__(config=config, submodules=submodules, **kwargs)
        _post_norm(self, submodules, config)

    def forward(self, hidden_states, *args, **kwargs):
        return _normed(self, super().forward(hidden_states, *args, **kwargs), "MLP")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """MCore's MLP sharded state dict (it asks every child for one, which a torch norm
        lacks) with the output norm's tensors added as replicated, as MCore saves norms."""
        norm = self._modules.pop("post_layernorm")
        try:
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self._modules["post_layernorm"] = norm
        out.update(sharded_state_dict_default(norm, f"{prefix}post_layernorm.", sharded_offsets,
                                              metadata))
        return out
