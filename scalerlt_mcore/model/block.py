"""The recurrent block: prelude (once) -> core (R loops, shared weights) -> coda (every loop).

Built from a block spec (``get_looped_gpt_block_spec``) whose ``LoopedBlockSubmodules`` name
every part, as MCore's ``TransformerBlockSubmodules`` do for its block.
"""

import contextlib
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import sharded_state_dict_default
from torch import nn

from .linear import ReplicatedLinear
from .recompute import checkpointed_layers, layer_chunks, recompute_active, run_layers


@dataclass
class LoopedBlockSubmodules:
    """The parts of a ``RecurrentTransformerBlock``; swap any of them by spec."""

    prelude: Union[ModuleSpec, type, None] = None
    """Layer spec of the prelude layers (run once before the first loop)."""

    core: Union[ModuleSpec, type, None] = None
    """Layer spec of the core layers (applied ``looped_num_loops`` times, shared weights)."""

    coda: Union[ModuleSpec, type, None] = None
    """Layer spec of the coda layers (run after every loop, before the readout)."""

    injection: Union[ModuleSpec, type, None] = None
    """How the embedded input re-enters each loop; None: no injection (s_r = core(s_{r-1}))."""

    final_layernorm: Union[ModuleSpec, type, None] = None
    """The shared readout's final norm."""

    exit_gate: Union[ModuleSpec, type, None] = None
    """The exit gate (built when ``looped_exit_gate``): normed loop state -> gate logit."""

    loop_weights: Union[ModuleSpec, type, None] = None
    """Learned loop credit (built when ``looped_learned_loop_weights``)."""


class LinearConcatInjection(MegatronModule):
    """x = W [s; e] with W [H, 2H] initialised to [I | 0]: at init the loop input is s."""

    def __init__(self, config):
        super().__init__(config=config)
        h = config.hidden_size
        weight = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        self.weight = nn.Parameter(weight.to(config.params_dtype))

    def forward(self, state, embed):
        return torch.matmul(torch.cat([state, embed], dim=-1), self.weight.t())  # [s, b, h]


class ExitGate(MegatronModule):
    """Gate logit g_r = w . norm(h_r) + b of every position (H -> 1, bias 0 at init):
    lambda_r = sigmoid(g_r) is the probability of exiting at loop r given no exit before. Its
    one output cannot be split over tensor-parallel ranks: whole on each (``ReplicatedLinear``),
    as the normed state it reads is."""

    def __init__(self, config):
        super().__init__(config=config)
        self.linear = ReplicatedLinear(config, config.hidden_size, 1)

    def forward(self, normed):
        return self.linear(normed).squeeze(-1)  # [s, b, 1] -> [s, b]


class LearnedLoopWeights(MegatronModule):
    """Trainable loop-credit logits [R] (zeros: equal weights at init); ``forward(R)`` returns
    the softmax of the first R."""

    def __init__(self, config):
        super().__init__(config=config)
        zeros = torch.zeros(config.looped_num_loops, dtype=config.params_dtype,
                            device="cpu")  # host init, as MCore's use_cpu_initialization
        self.logits = nn.Parameter(zeros)

    def forward(self, loops: int):
        if loops > self.logits.numel():
            raise ValueError(f"learned loop weights hold {self.logits.numel()} loops (the "
                             f"looped_num_loops they were built with), got R = {loops}")
        return torch.softmax(self.logits[:loops], dim=0)


def exit_log_distribution(gate_logits):
    """log p(r) [R, ...] of exiting at loop r from the gate logits [R, ...]: log lambda_r +
    sum_{j<r} log(1 - lambda_j); the last loop takes the remaining mass (its own gate unused)."""
    stay = F.logsigmoid(-gate_logits)  # log(1 - lambda_r)
    before = torch.cumsum(stay, dim=0) - stay  # sum_{j<r} log(1 - lambda_j)
    leave = torch.cat([F.logsigmoid(gate_logits[:-1]), torch.zeros_like(gate_logits[-1:])])
    return leave + before


class RecurrentTransformerBlock(MegatronModule):
    """Prelude layers run once; core layers (``layers``, named as in MCore's block) run
    ``looped_num_loops`` times; coda layers run after every loop. ``forward`` returns the
    readout input of every loop: pre-final-norm, or with ``looped_normed_state`` (Ouro) the
    state the final norm closed the loop with. Activation recompute by the config's
    ``recompute_*`` settings (``recompute.py``)."""

    def __init__(self, config, submodules: LoopedBlockSubmodules):
        super().__init__(config=config)
        n_pre, n_core = config.looped_num_prelude_layers, config.num_layers
        n_coda = config.looped_num_coda_layers
        self.prelude = self._layers(submodules.prelude, 1, n_pre)
        self.layers = self._layers(submodules.core, n_pre + 1, n_core)
        self.coda = self._layers(submodules.coda, n_pre + n_core + 1, n_coda)
        self.injection = _optional(submodules.injection, config)
        gate = getattr(config, "looped_exit_gate", False)
        learned = getattr(config, "looped_learned_loop_weights", False)
        self.exit_gate = _optional(submodules.exit_gate, config) if gate else None
        self.loop_weights = _optional(submodules.loop_weights, config) if learned else None
        for flag, name, module in ((gate, "exit_gate", self.exit_gate),
                                   (learned, "loop_weights", self.loop_weights)):
            if flag and module is None:
                raise ValueError(f"the config asks for the {name} module but the block spec "
                                 f"has none (LoopedBlockSubmodules.{name})")
        self.final_layernorm = build_module(
            submodules.final_layernorm, config=config, hidden_size=config.hidden_size,
            eps=config.layernorm_epsilon,
        )

    def _layers(self, spec, first_number: int, count: int) -> nn.ModuleList:
        if count and spec is None:
            raise ValueError(f"the block spec has no layer spec for {count} layers "
                             f"(layer numbers from {first_number})")
        return nn.ModuleList(
            build_module(spec, config=self.config, layer_number=first_number + i)
            for i in range(count)
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """For distributed checkpoints: every layer's own sharded state dict (tensor-parallel
        shards with their global shapes, MCore's layer key map), as MCore's
        ``TransformerBlock`` does. MegatronModule's default would reach the layers through
        their ``nn.ModuleList``, which has none, and save every tensor as replicated: under
        tensor parallelism one rank's shard as the whole tensor."""
        tp_group = getattr(self, "tp_group", None) or (
            parallel_state.get_tensor_model_parallel_group())  # as MegatronModule's default
        out = {}
        for name, child in self.named_children():
            members = child.named_children() if isinstance(child, nn.ModuleList) else [("", child)]
            for index, module in members:
                key = f"{prefix}{name}." + (f"{index}." if index else "")
                out.update(sharded_state_dict_default(module, key, sharded_offsets, metadata,
                                                      tp_group=tp_group))
        return out

    def forward(self, hidden, attention_mask=None, ctx=None, rotary_pos_emb=None,
                initial_state=None, num_loops: Optional[int] = None) -> list:
        """hidden [s, b, h] -> R tensors [s, b, h], one per loop; R = ``num_loops`` (None: the
        config's ``looped_num_loops``). ``initial_state`` [s, b, h]: s_0 of
        ``looped_initial_state`` ``random`` (drawn by the model)."""
        config = self.config.with_loops(num_loops)
        depth = 0

        def run(layers, x):
            nonlocal depth
            for start, end, checkpoint in layer_chunks(self.config, len(layers)):
                part = layers[start:end]
                if checkpoint and recompute_active(self):  # not in graph-free loops
                    x = checkpointed_layers(part, x, depth, ctx, attention_mask, rotary_pos_emb,
                                            self.config)
                else:
                    x = run_layers(part, x, depth, ctx, attention_mask, rotary_pos_emb)
                depth += len(part)
            return x

        embed = run(self.prelude, hidden)
        state = self._initial_state(embed, initial_state)
        readouts = []
        for r in range(config.looped_num_loops):
            with loop_grad_context(config, r):
                x = state if self.injection is None else self.injection(state, embed)
                state = run(self.layers, x)
                if self.config.looped_normed_state:
                    state = self.final_layernorm(state)  # what the next loop and readout see
                coda_in = (self.final_layernorm(state) if self.config.looped_norm_before_coda
                           else state)
                readouts.append(run(self.coda, coda_in))
        return readouts

    def _initial_state(self, embed, drawn):
        kind = self.config.looped_initial_state
        if kind == "random":
            if drawn is None or drawn.shape != embed.shape:
                raise ValueError("looped_initial_state 'random' needs the drawn initial state of "
                                 "every position (LoopedGPTModel draws it)")
            return drawn.to(embed.dtype)
        return embed if kind == "embed" else torch.zeros_like(embed)


def loop_grad_context(config, loop: int):
    """``no_grad`` for a loop that truncated backprop leaves graph-free
    (``looped_backprop_loops``), else a null context."""
    if loop < config.looped_num_graph_free_loops:
        return torch.no_grad()
    return contextlib.nullcontext()


def _optional(spec: Optional[Union[ModuleSpec, type]], config):
    return None if spec is None else build_module(spec, config=config)
