"""Sandwich layers: the norms MCore's ``TransformerLayer`` lacks, added by spec.

Ouro / LoopLM normalises each sublayer's *output* before the residual add.
``SandwichSelfAttention`` / ``SandwichMLP`` are the looped self-attention and MCore's MLP with
one more norm submodule (``post_layernorm``) applied to their output, so MCore's layer computes

    x = x + post_attn_norm(attention(input_layernorm(x)))
    x = x + post_mlp_norm(mlp(pre_mlp_layernorm(x)))

with MCore's own bias-dropout-add doing the residual adds. Both need bias-free linear layers
(a bias would be added after the norm by MCore's bias-dropout-add).

Huginn normalises *after* the residual add, which MCore's layer cannot express:
``ResidualNormTransformerLayer`` (a ``TransformerLayer`` subclass with two more norm submodules)
computes

    x = post_attn_residual_norm(x + attention(input_layernorm(x)))
    x = post_mlp_residual_norm(x + mlp(pre_mlp_layernorm(x)))

and ``QKBiasSelfAttention`` adds Huginn's per-head query and key biases (no value bias) before
RoPE.
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint
from torch import nn

from .attention import LoopedSelfAttention
from .layer import LoopedMLP


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


class SandwichMLP(LoopedMLP):
    """MCore's ``MLP`` (``LoopedMLP``) whose output is normalised (``post_layernorm``)."""

    def __init__(self, config, submodules: SandwichMLPSubmodules, **kwargs):
        super().__init__(config=config, submodules=submodules, **kwargs)
        _post_norm(self, submodules, config)

    def forward(self, hidden_states, *args, **kwargs):
        return _normed(self, super().forward(hidden_states, *args, **kwargs), "MLP")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """MCore's MLP sharded state dict (it asks every child for one, which a torch norm
        lacks) with the output norm's tensors added as replicated, as MCore saves norms (one
        main replica in the tensor-parallel group: without the group every rank claimed it)."""
        norm = self._modules.pop("post_layernorm")
        try:
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self._modules["post_layernorm"] = norm
        tp_group = getattr(self, "tp_group", None) or (
            parallel_state.get_tensor_model_parallel_group())  # one main replica per TP group
        out.update(sharded_state_dict_default(norm, f"{prefix}post_layernorm.", sharded_offsets,
                                              metadata, tp_group=tp_group))
        return out


# ---- Huginn: norms after the residual adds, query/key biases ------------------------------


@dataclass
class ResidualNormLayerSubmodules(TransformerLayerSubmodules):
    """``TransformerLayerSubmodules`` with the norms applied after each residual add."""

    post_attn_residual_layernorm: Union[ModuleSpec, type] = None
    """Norm of (input + attention output)."""

    post_mlp_residual_layernorm: Union[ModuleSpec, type] = None
    """Norm of (its input + MLP output): the layer's output."""


class ResidualNormTransformerLayer(TransformerLayer):
    """MCore ``TransformerLayer`` whose residual sums are normalised (Huginn's block): its
    attention, MLP and input norms are MCore's, built by MCore from the same spec fields."""

    def __init__(self, config, submodules: ResidualNormLayerSubmodules, **kwargs):
        super().__init__(config=config, submodules=submodules, **kwargs)
        for name in ("post_attn_residual_layernorm", "post_mlp_residual_layernorm"):
            setattr(self, name, build_module(getattr(submodules, name), config=config,
                                             hidden_size=config.hidden_size,
                                             eps=config.layernorm_epsilon))

    def forward(self, hidden_states, attention_mask=None, inference_context=None,
                rotary_pos_emb=None, **unused):
        """hidden_states [s, b, h] -> ([s, b, h], None), as ``TransformerLayer.forward``."""
        attn = _no_bias(self.self_attention(
            self.input_layernorm(hidden_states), attention_mask=attention_mask,
            inference_context=inference_context, rotary_pos_emb=rotary_pos_emb), "attention")
        x = self.post_attn_residual_layernorm(hidden_states + attn)
        mlp = _no_bias(self.mlp(self.pre_mlp_layernorm(x)), "MLP")
        return self.post_mlp_residual_layernorm(x + mlp), None


def _no_bias(output_with_bias, what: str):
    output, bias = output_with_bias
    if bias is not None:
        raise ValueError(f"residual-norm layer {what}: linear biases are not supported "
                         f"(add_bias_linear must be False)")
    return output


class QKBiasSelfAttention(LoopedSelfAttention):
    """``LoopedSelfAttention`` with a bias per query head and per key head (``qk_bias``
    [2, 1, heads, head_dim]: query, key), added before RoPE; no value bias. Needs as many K/V
    heads as query heads (Huginn's layout). Under tensor parallelism a rank holds the biases
    of its own heads (axis 2), as ``linear_qkv`` holds their projections."""

    def __init__(self, config, submodules, **kwargs):
        super().__init__(config=config, submodules=submodules, **kwargs)
        heads = config.num_attention_heads
        if (config.num_query_groups or heads) != heads:
            raise ValueError(f"qk bias needs num_query_groups == num_attention_heads ({heads}), "
                             f"got {config.num_query_groups}")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        zeros = torch.zeros(2, 1, self.num_attention_heads_per_partition, config.kv_channels,
                            dtype=config.params_dtype, device=device)
        self.qk_bias = nn.Parameter(zeros)
        set_tensor_model_parallel_attributes(self.qk_bias, True, QK_BIAS_HEAD_AXIS, 1)

    def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
        query, key, value = super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
        return query + self.qk_bias[0], key + self.qk_bias[1], value  # [s, b, n, hn]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """MCore's, with ``qk_bias`` sharded over the tensor-parallel ranks by head (MCore's
        default saves a module's own parameter as replicated)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}qk_bias"
        out[key] = make_tp_sharded_tensor_for_checkpoint(
            self.qk_bias, key, tp_axis=QK_BIAS_HEAD_AXIS, prepend_offsets=sharded_offsets)
        return out


QK_BIAS_HEAD_AXIS = 2
"""The head axis of ``qk_bias`` [2, 1, heads, head_dim]: the one tensor parallelism splits."""
