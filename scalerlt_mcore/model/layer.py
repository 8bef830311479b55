"""MCore's ``TransformerLayer`` and ``MLP`` with direct paths for forwards that record no graph.

A decode step of a small model is bound by host time (``benchmarks/decode.py``), and MCore's
layer forward spends it on what a plain no-grad forward does not use: the activation-offloading
contexts, the recompute, MoE and fused-inference-communication branches, the cross-attention
placeholders and their bias-dropout-add, NVTX ranges, and the bias-dropout-add itself (a
TorchScript function called under ``torch.enable_grad``). ``LoopedTransformerLayer`` computes
the same tensors directly when no graph is recorded and the layer is in its plain layout
(``_direct``):

    x = x + attention(input_layernorm(x))
    x = x + mlp(pre_mlp_layernorm(x))

each add plain where it is one add (no bias, the residual in the output's dtype), else MCore's
bias-dropout-add (its TorchScript-fused form rounds bias + output + residual once, so a plain
two-add version would differ in the last bit). Bitwise MCore's forward
(``tests/model/test_layer.py``); otherwise, and always when training, MCore's forward runs.
Same parameters and state dict as MCore's layer; the looped layer specs build it in place of
``TransformerLayer`` (``specs._looped``).

``LoopedMLP`` likewise: MCore's gated MLP computes act(x_glu) * (x_linear + glu_linear_offset),
an add over the whole intermediate activation even at the default offset 0 (at the decode
bench's RL prefill, 1.4 ms of a 20 ms layer application on one thread); without a recorded
graph it is act(x_glu) * x_linear there, the same values (x + 0.0 is x, -0.0 aside, whose sign
no sum of the next matmul keeps unless all its terms are zero).
"""

from typing import Optional

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor


def _direct(layer: TransformerLayer) -> bool:
    """The forward may skip MCore's layer machinery: no graph is recorded, dropout is off and
    nothing of the layer's layout needs the machinery."""
    config = layer.config
    return (not torch.is_grad_enabled()
            and (not layer.training or layer.hidden_dropout == 0)
            and not layer.is_moe_layer
            and isinstance(layer.cross_attention, IdentityOp)
            and isinstance(layer.pre_cross_attn_layernorm, IdentityOp)
            and not (layer.recompute_input_layernorm or layer.recompute_pre_mlp_layernorm
                     or layer.recompute_mlp)
            and not (getattr(layer, "offload_attn_norm", False)
                     or getattr(layer, "offload_mlp_norm", False))
            and not getattr(config, "inference_fuse_tp_communication", False)
            and getattr(config, "mlp_chunks_for_prefill", 1) <= 1)


def _plain_add(output_with_bias: tuple, residual: Tensor) -> bool:
    """MCore's bias-dropout-add without dropout is one add here: no bias and the residual in
    the output's dtype (one add is rounded once, fused or not)."""
    output, bias = output_with_bias
    return bias is None and residual.dtype == output.dtype


class LoopedTransformerLayer(TransformerLayer):
    """MCore's ``TransformerLayer``; without a recorded graph, computed directly."""

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                inference_context=None, rotary_pos_emb=None, **kwargs):
        """hidden_states [s, b, h] -> ([s, b, h], None), as ``TransformerLayer.forward``."""
        if kwargs or not _direct(self):
            return super().forward(hidden_states, attention_mask=attention_mask,
                                   inference_context=inference_context,
                                   rotary_pos_emb=rotary_pos_emb, **kwargs)
        attention = self.self_attention(
            self.input_layernorm(hidden_states), attention_mask=attention_mask,
            inference_context=inference_context, rotary_pos_emb=rotary_pos_emb)
        x = self._residual_add(self.self_attn_bda, attention, hidden_states)
        mlp = self.mlp(self.pre_mlp_layernorm(x))
        return self._residual_add(self.mlp_bda, mlp, x), None

    def _residual_add(self, bda, output_with_bias: tuple, residual: Tensor) -> Tensor:
        """residual + output; with a bias or a residual of another dtype, MCore's own
        bias-dropout-add (``bda``), as MCore's forward calls it: fused, it rounds the sum of
        three terms once."""
        if _plain_add(output_with_bias, residual):
            return residual + output_with_bias[0]
        with self.bias_dropout_add_exec_handler():
            return bda(self.training, self.config.bias_dropout_fusion)(
                output_with_bias, residual, self.hidden_dropout)


def _direct_glu(mlp: MLP, per_token_scale, kwargs: dict) -> bool:
    """The MLP's forward may skip the offset add: no graph is recorded, the MLP is gated with
    MCore's unfused activation at offset 0, unclamped, and no per-token scale is passed."""
    config = mlp.config
    return (not torch.is_grad_enabled() and per_token_scale is None and not kwargs
            and config.gated_linear_unit and config.glu_linear_offset == 0
            and getattr(config, "activation_func_clamp_value", None) is None
            and not config.use_te_activation_func and not config.bias_activation_fusion)


class LoopedMLP(MLP):
    """MCore's ``MLP``; gated, without a recorded graph, computed without the offset add."""

    def forward(self, hidden_states: Tensor, per_token_scale=None, **kwargs):
        """hidden_states [s, b, h] -> (output [s, b, h], bias or None), as ``MLP.forward``."""
        if not _direct_glu(self, per_token_scale, kwargs):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)  # [s, b, 2 * ffn / tp]
        if bias is not None:
            intermediate = intermediate + bias
        x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
        return self.linear_fc2(self.config.activation_func(x_glu) * x_linear)
