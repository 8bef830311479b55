"""Activation recompute of the looped block, as MCore's ``TransformerConfig`` asks for it
(Megatron-LM's ``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``).

``full`` checkpoints layer applications through MCore's ``tensor_parallel.checkpoint``
(tensor-parallel and RNG aware): only a chunk's input is saved, its layers run again in the
backward. The method applies to each run of a layer list, as MCore's ``_checkpointed_forward``
to a block's layers: the prelude once, then in every loop the core layers and the coda layers.
``uniform``: chunks of ``recompute_num_layers`` consecutive layers; ``block``: the first
``recompute_num_layers`` layers one by one, the rest without recompute. ``selective`` is
MCore's per-module recompute (``recompute_modules``): ``core_attn`` in ``LoopedSelfAttention``
(``checkpointed``), the others in MCore's ``TransformerLayer``.

A chunk's K/V routing goes through the checkpoint: the prefix K/V its depths attend to are
inputs (their gradient returns through the checkpoint), the K/V it records are outputs.
Only where a graph is recorded and the module trains; decoding and scoring are unaffected.
"""

import dataclasses

import torch
from megatron.core import tensor_parallel
from torch import Tensor

from .kv import exit_read, loop_of


def recompute_active(module) -> bool:
    """Recompute applies to this call: the module trains and a graph is recorded."""
    return module.training and torch.is_grad_enabled()


def checkpointed(function, *tensors):
    """``function(*tensors)`` through MCore's checkpoint (only tensors and None as inputs)."""
    return tensor_parallel.checkpoint(function, False, *tensors)


def layer_chunks(config, count: int) -> list:
    """One run of ``count`` layers as [(start, end, checkpointed)] by the config's
    ``recompute_method`` (``full`` granularity only; otherwise one plain chunk)."""
    if config.recompute_granularity != "full" or count == 0:
        return [(0, count, False)]
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(i, min(i + n, count), True) for i in range(0, count, n)]
    chunks = [(i, i + 1, True) for i in range(min(n, count))]
    return chunks + ([(n, count, False)] if n < count else [])


def run_layers(layers, x: Tensor, first_depth: int, ctx, attention_mask, rotary_pos_emb):
    """The layers applied in turn at virtual depths ``first_depth``, ... (``ctx.depth``)."""
    for i, layer in enumerate(layers):
        if ctx is not None:
            ctx.depth = first_depth + i
        x, _ = layer(x, attention_mask=attention_mask, inference_context=ctx,
                     rotary_pos_emb=rotary_pos_emb)
        if not torch.is_grad_enabled():
            # MCore's TransformerLayer adds its biases under torch.enable_grad() (its
            # bias_dropout_add_exec_handler): drop that graph in a no_grad region
            x = x.detach()
    return x


def checkpointed_layers(layers, x: Tensor, first_depth: int, ctx, attention_mask,
                        rotary_pos_emb, config) -> Tensor:
    """``run_layers`` as one checkpointed chunk: the prefix K/V of its depths enter as inputs,
    the K/V it records (``ctx.record``) leave as outputs and are stored in ``ctx.recorded``;
    with exit depths (``ctx.exits``) the exit K/V its depths read one loop earlier enter and
    those of its depths leave (``LoopKV.used``)."""
    depths = list(range(first_depth, first_depth + len(layers)))
    prefix = _prefix_kv(ctx, depths)
    record = ctx is not None and ctx.record
    exits = ctx is not None and ctx.exits is not None
    reads = [r for r in (exit_read(config, d) for d in depths) if r is not None] if exits else []
    looped = [d for d in depths if loop_of(config, d) is not None] if exits else []
    kept = [t for r in reads for t in ctx.used.pop(r)]  # the exit K/V (inputs) the chunk reads
    width = 3 if record and ctx.record_inputs else 2  # tensors kept per exit depth
    # the checkpoint's node keeps ``forward`` for its backward: a closure over ``ctx`` itself
    # would reach, through ``ctx.recorded``, tensors whose graph holds that node, a cycle
    # through autograd's C++ that no collection frees (every step's K/V, the model)
    template = None if ctx is None else dataclasses.replace(ctx, recorded={}, used={})

    def forward(x, attention_mask, rotary_pos_emb, *inputs):
        inner = _chunk_context(template, depths, inputs[: len(prefix)])
        if exits:
            kept = inputs[len(prefix):]
            inner.used = {r: tuple(kept[width * i: width * (i + 1)]) for i, r in enumerate(reads)}
        x = run_layers(layers, x, first_depth, inner, attention_mask, rotary_pos_emb)
        out = [x]
        if record:
            out += [t for d in depths for t in inner.recorded[d]]
        if exits:
            out += [t for d in looped for t in inner.used[d]]
        return out[0] if len(out) == 1 else tuple(out)

    # MCore's reentrant checkpoint passes gradients only if an input requires grad
    x = x if x.requires_grad else x.detach().requires_grad_(True)
    out = tensor_parallel.checkpoint(forward, config.distribute_saved_activations, x,
                                     attention_mask, rotary_pos_emb, *prefix, *kept)
    if not (record or looped):
        return out
    per = 1 if ctx.record_inputs else 2  # tensors recorded per depth
    if record:
        for i, d in enumerate(depths):
            ctx.recorded[d] = tuple(out[1 + per * i: 1 + per * (i + 1)])
    if looped:
        used = out[1 + per * len(depths) * record:]
        for i, d in enumerate(looped):
            ctx.used[d] = tuple(used[width * i: width * (i + 1)])
    return out[0]


def _prefix_kv(ctx, depths: list) -> list:
    """The prefix state tensors of ``depths``, depth by depth (none without a prefix state)."""
    if ctx is None or ctx.prefix is None:
        return []
    return [t for d in depths for t in ctx.prefix.at(d)]


def _chunk_context(ctx, depths: list, prefix_kv: tuple):
    """A copy of ``ctx`` for one checkpointed chunk: its own ``recorded``, and the prefix state
    tensors of its depths replaced by the checkpoint's inputs."""
    if ctx is None:
        return None
    prefix = ctx.prefix
    if prefix is not None:
        prefix = prefix.with_depths(depths, list(prefix_kv))
    return dataclasses.replace(ctx, prefix=prefix, recorded={})

