"""MCore's ``TransformerLayer`` with a direct path for forwards that record no graph.

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
"""

from typing import Optional

import torch
from megatron.core.transformer.identity_op import IdentityOp
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
