"""The looped GPT: MCore embedding -> recurrent block -> shared readout after every loop."""

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.spec_utils import build_module
from torch import Tensor

from .attention import RotaryAngles
from .block import exit_log_distribution, loop_grad_context
from .config import POSITION_EMBEDDING_TYPES, step_seed
from .host_syncs import mark_host
from .kv import CacheStep, DepthKVCache, LoopKV, PrefixState, state_signature, upload
from .linear import ColumnParallelLinear
from .specs import get_looped_gpt_block_spec, is_block_spec
from .streamed_readout import streamed_logprobs
from .vocab_parallel import gather_vocab, logprob_temperature, token_logprobs

INITIAL_STATE_SALT = 271_828
"""``step_seed``'s salt of the drawn initial state."""


@functools.lru_cache(maxsize=1)
def initial_state_table(seed: int, step: int, length: int, hidden: int, std: float,
                        scale: float) -> Tensor:
    """Huginn's random initial state made deterministic: [length, hidden] (one row per absolute
    position, the same for every sequence), fp64 on the host, a normal (mean 0, ``std``; Huginn's
    is sqrt(2 / (5 hidden))) truncated at 3 std (``torch.nn.init.trunc_normal_``) times
    ``scale`` (the embedding scale), from a CPU generator seeded with ``step_seed`` of rank 0
    and ``INITIAL_STATE_SALT``: (seed * 1000003 + step * 10007 + 271828) mod (2^31 - 1).
    The last table is kept: the policy and the KL reference draw the same one each step (at
    Huginn-0125's 4,096 x 5,280, 3 s of host time per draw). Read only."""
    gen = torch.Generator(device="cpu").manual_seed(step_seed(seed, step, 0, INITIAL_STATE_SALT))
    table = torch.empty(length, hidden, dtype=torch.float64, device="cpu")
    torch.nn.init.trunc_normal_(table, 0.0, std, -3 * std, 3 * std, generator=gen)
    return table * scale


@dataclass
class LoopedOutput:
    """Per-loop results of a forward.

    logits:       R tensors [B, S, V / tp] (when no labels are given; split over the
                  vocabulary under tensor parallelism, as MCore's parallel_output), else None.
    logprobs:     [R, B, S] log-probs of ``labels`` (when given), else None.
    exit_logprobs: [R, B, S] log p(exit at loop r) of every position (exit gate on), else None.
    prefix_state: the K/V of every depth and the per-loop boundary (when requested).
    """

    logits: Optional[list] = None
    logprobs: Optional[Tensor] = None
    exit_logprobs: Optional[Tensor] = None
    prefix_state: Optional[PrefixState] = None


def check_exit_depths(exits: Optional[Tensor], input_ids: Tensor, kv_cache, loops: int) -> None:
    """Exit depths are integers in 1..R, one per input position, replayed in training and
    scoring forwards only (decoding runs every loop)."""
    if exits is None:
        return
    if kv_cache is not None:
        raise ValueError("exit_depths are replayed by training and scoring forwards, not with a "
                         "kv_cache")
    if exits.shape != input_ids.shape or exits.is_floating_point():
        raise ValueError(f"exit_depths must be integers of input_ids' shape "
                         f"{tuple(input_ids.shape)}, got {exits.dtype} {tuple(exits.shape)}")
    if exits.numel() and not bool(((exits >= 1) & (exits <= loops)).all()):
        raise ValueError(f"exit_depths must lie in 1..{loops} (the loops of this forward)")


def check_state_kind(kind: str) -> None:
    """A prefix state keeps ``kv`` or ``inputs``."""
    if kind not in ("kv", "inputs"):
        raise ValueError(f"state_kind must be 'kv' or 'inputs', got {kind!r}")


class LoopedGPTModel(LanguageModule):
    """GPT with a looped core. With R=1, no prelude/coda and no injection it is the same
    function as MCore's ``GPTModel`` with the same weights (same parameter names).

    ``transformer_layer_spec``: a block spec (``get_looped_gpt_block_spec``), or, as MCore's
    ``GPTModel`` accepts, one layer spec used for every layer (local final norm).
    ``rope_scaling`` / ``rope_scaling_factor``: Llama 3.x RoPE frequency scaling, as in MCore's
    ``GPTModel`` (low/high frequency factors 1 and 4, original context 8192).

    Tensor parallelism as in MCore's layers (``vocab_size``: padded as Megatron pads it, to a
    multiple of the TP size): each rank holds its heads' K/V, so prefix states and decoding
    caches are per rank; log-probs use MCore's vocab-parallel cross entropy, or with
    ``looped_readout_tile`` > 0 the streamed readout (``streamed_readout.py``: over vocabulary
    tiles, no logits kept for the backward; decoding's logits are the output layer's either way).

    Log-probs of labels are those of the distribution the tokens were sampled from at the
    temperature of ``logprobs_at`` (default 1: the logits as they are)."""

    _logprob_temperature = 1.0
    """T of every log-prob of labels (``_logprobs``): log_softmax(logits / T)."""

    def __init__(self, config, transformer_layer_spec, vocab_size: int,
                 max_sequence_length: int, pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: str = "learned_absolute", rotary_percent: float = 1.0,
                 rotary_base: int = 10000, rope_scaling: bool = False,
                 rope_scaling_factor: float = 8.0, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self._check_tensor_parallel(config, vocab_size)
        if not (pre_process and post_process):
            raise NotImplementedError("looped GPT does not support pipeline parallelism")
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type must be one of "
                             f"{POSITION_EMBEDDING_TYPES}, got {position_embedding_type!r}")
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.rope_settings = dict(rotary_base=rotary_base, rope_scaling=rope_scaling,
                                  rope_scaling_factor=rope_scaling_factor,
                                  rotary_percent=rotary_percent)  # for export (hf_export.py)
        self.model_type = ModelType.encoder_or_decoder
        self.embedding = LanguageModelEmbedding(
            config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
            position_embedding_type=position_embedding_type, tp_group=self.pg_collection.tp,
        )
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved, rotary_base=rotary_base,
                rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
                use_cpu_initialization=config.use_cpu_initialization,
            )
        block_spec = (transformer_layer_spec if is_block_spec(transformer_layer_spec)
                      else get_looped_gpt_block_spec(config, layer_spec=transformer_layer_spec))
        self.decoder = build_module(block_spec, config=config)
        self.output_layer = ColumnParallelLinear(
            config.hidden_size, vocab_size, config=config, init_method=config.init_method,
            bias=False, skip_bias_add=False, gather_output=not parallel_output,
            skip_weight_param_allocation=share_embeddings_and_output_weights,
            tp_group=self.pg_collection.tp,
        )
        self.setup_embeddings_and_output_layer()

    def _check_tensor_parallel(self, config, vocab_size: int) -> None:
        tp = self.pg_collection.tp.size()
        if tp != config.tensor_model_parallel_size:
            raise ValueError(f"config.tensor_model_parallel_size is "
                             f"{config.tensor_model_parallel_size} but the tensor-parallel group "
                             f"has {tp} ranks")
        if vocab_size % tp:
            raise ValueError(f"vocab_size {vocab_size} is not divisible by the tensor-parallel "
                             f"size {tp}: pad it as Megatron does (make_vocab_size_divisible_by "
                             f"x tensor_model_parallel_size)")

    def set_input_tensor(self, input_tensor) -> None:
        """MCore schedules call this; without pipeline parallelism there is nothing to set."""

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None, *,
                prefix_state: Optional[PrefixState] = None,
                kv_cache: Optional[DepthKVCache] = None, return_prefix_state: bool = False,
                readout: bool = True, num_loops: Optional[int] = None,
                exit_depths: Optional[Tensor] = None, state_kind: str = "kv") -> LoopedOutput:
        """input_ids [B, S]. ``prefix_state``: attend to a prompt computed separately (positions
        continue after it). ``kv_cache``: decoding. ``attention_mask`` follows MCore (True =
        masked, [B or 1, 1, S, S]); default causal. ``readout=False`` skips the readouts.
        ``num_loops``: R of this call (None: the config's ``looped_num_loops``); a prefix state
        or cache must come from a call with the same R. ``exit_depths`` [B, S]: the loops each
        position ran in a serving engine that exits early (1..R), whose K/V later positions
        read as the engine keeps it (``LoopKV.exit_kv``); None: every position runs R.
        ``state_kind`` (with ``return_prefix_state``): what the returned state keeps per depth,
        ``kv`` or ``inputs`` (``PrefixState.inputs``)."""
        config = self.config.with_loops(num_loops)
        self.check_inputs(input_ids, labels, prefix_state, kv_cache, config)
        check_exit_depths(exit_depths, input_ids, kv_cache, config.looped_num_loops)
        check_state_kind(state_kind)
        states, ctx = self._loop_states(input_ids, position_ids, attention_mask, prefix_state,
                                        kv_cache, return_prefix_state,
                                        num_loops=config.looped_num_loops, exits=exit_depths,
                                        record_inputs=return_prefix_state
                                        and state_kind == "inputs")
        out = LoopedOutput()
        if return_prefix_state:
            out.prefix_state = self._collect_prefix_state(ctx, states, config)
        if readout:
            self._readout_all(states, labels, out)
        return out

    def _loop_states(self, input_ids, position_ids, attention_mask, prefix_state, kv_cache,
                     record: bool, step: Optional[CacheStep] = None,
                     num_loops: Optional[int] = None, exits: Optional[Tensor] = None,
                     record_inputs: bool = False) -> tuple:
        """Embedding and the looped block -> (R readout inputs [S, B, H], the LoopKV context
        or None). ``step``: the cache's reads and writes (default: planned from its lengths);
        ``exits`` [B, S]: the positions' exit depths (``forward``'s ``exit_depths``);
        ``record_inputs``: record a state of kind ``inputs``."""
        if step is None and kv_cache is not None:
            step = kv_cache.plan(input_ids.shape[1])
        positions, span = self._positions(input_ids, position_ids, prefix_state, step)  # [B, S]
        ctx = None
        if prefix_state is not None or kv_cache is not None or record or exits is not None:
            ctx = LoopKV(prefix=prefix_state, cache=kv_cache, positions=positions, step=step,
                         record=record, record_inputs=record_inputs,
                         prefix_attention=self.config.looped_prefix_attention,
                         exits=None if exits is None else exits.t())  # [S, B]
            if prefix_state is not None and prefix_state.inputs is not None:
                P = prefix_state.length
                ctx.prefix_rope = self._rope(torch.arange(P, device=input_ids.device)[None], P)
        hidden = self.embedding(input_ids=input_ids, position_ids=positions)  # [S, B, H]
        if self.config.looped_embedding_scale != 1.0:
            hidden = hidden * self.config.looped_embedding_scale  # Huginn's sqrt(H)
        drawn = (self.initial_state(positions) if self.config.looped_initial_state == "random"
                 else None)
        return self.decoder(hidden, attention_mask, ctx, self._rope(positions, span),
                            initial_state=drawn, num_loops=num_loops), ctx

    # ---- the drawn initial state (looped_initial_state random) -----------------------------

    def set_initial_state_draw(self, seed: int, step: int = 0) -> None:
        """Draw s_0 of ``looped_initial_state`` ``random`` from (seed, step) from now on (the
        same table for the prompt producer, the replay and the rollouts of a step)."""
        self._state_draw, self._state_table = (int(seed), int(step)), None

    def initial_state(self, positions: Tensor) -> Tensor:
        """s_0 [S, B, H] at absolute positions [B, S]: rows of ``initial_state_table``."""
        draw = getattr(self, "_state_draw", (0, 0))
        p = next(self.parameters())
        key = (draw, p.device, p.dtype)
        cached = getattr(self, "_state_table", None)
        if cached is None or cached[0] != key:  # moved to the device once per draw
            c = self.config
            shape = (self.max_sequence_length, c.hidden_size)
            table = (torch.empty(shape, device=p.device, dtype=p.dtype)  # meta: no values
                     if p.device.type == "meta" else initial_state_table(
                         *draw, *shape, c.looped_drawn_state_std, c.looped_embedding_scale))
            self._state_table = cached = (key, table.to(p.device, p.dtype))
        return cached[1][positions].transpose(0, 1)  # [S, B, H]

    def _readout_all(self, states: list, labels: Optional[Tensor], out: LoopedOutput) -> None:
        """Every loop's readout (and exit gate); a loop left graph-free by truncated backprop
        reads out under ``no_grad`` too (it adds to the loss value, not to any gradient)."""
        config = self.config.with_loops(len(states))
        reads = [self._loop_readout(r, h, labels, config) for r, h in enumerate(states)]
        if labels is None:
            out.logits = [value for value, _ in reads]
        else:
            out.logprobs = torch.stack([value for value, _ in reads])  # [R, B, S]
        if self.decoder.exit_gate is not None:
            out.exit_logprobs = exit_log_distribution(torch.stack([g for _, g in reads]))

    def _loop_readout(self, loop: int, hidden: Tensor, labels: Optional[Tensor] = None,
                      config=None):
        with loop_grad_context(config or self.config, loop):
            if labels is None:
                return self.readout_and_gate(hidden)
            return self._labels_readout(hidden, labels)

    def _labels_readout(self, hidden: Tensor, labels: Tensor) -> tuple:
        """hidden [S, B or 1, H] (pre-final-norm) -> (log-probs [B, S] of labels [B, S],
        exit-gate logits [B or 1, S] or None): with ``looped_readout_tile`` streamed over
        vocabulary tiles (``streamed_logprobs``: no logits kept), else from the logits."""
        tile = self.config.looped_readout_tile
        if not tile:
            logits, gate = self.readout_and_gate(hidden)
            return self._logprobs(logits.expand(labels.shape[0], -1, -1), labels), gate
        normed = self._normed(hidden)
        logprobs = streamed_logprobs(normed.expand(-1, labels.shape[0], -1),
                                     self._output_weight(), labels, tile, self.pg_collection.tp,
                                     self._logprob_temperature)
        return logprobs, self._gate(normed)

    def _logprobs(self, logits: Tensor, labels: Tensor) -> Tensor:
        return token_logprobs(logits, labels, self.pg_collection.tp, self._logprob_temperature)

    @contextlib.contextmanager
    def logprobs_at(self, temperature: float):
        """Within: every log-prob of labels (forward, ``suffix_readouts``, ``extend``, ...) is
        that of tokens sampled at ``temperature``, log_softmax(logits / T) (top-p not applied;
        greedy, 0: T = 1; ``logprob_temperature``), so that the ratio of a PPO update compares
        the distribution the samples were drawn from. Logits (decoding) are never scaled."""
        previous, self._logprob_temperature = (self._logprob_temperature,
                                               logprob_temperature(temperature))
        try:
            yield
        finally:
            self._logprob_temperature = previous

    def readout(self, hidden: Tensor) -> Tensor:
        """Shared readout: hidden [S, B, H] (pre-final-norm) -> logits [B, S, V / tp]."""
        return self.readout_and_gate(hidden, gate=False)[0]

    def readout_and_gate(self, hidden: Tensor, gate: bool = True) -> tuple:
        """hidden [S, B, H] -> (logits [B, S, V / tp], exit-gate logits [B, S] from the same
        normed state, or None without a gate or with ``gate=False``)."""
        normed = self._normed(hidden)
        weight = (self.shared_embedding_or_output_weight()
                  if self.share_embeddings_and_output_weights else None)
        logits, _ = self.output_layer(normed, weight=weight)
        return logits.transpose(0, 1).contiguous(), self._gate(normed) if gate else None

    def _normed(self, hidden: Tensor) -> Tensor:
        """The readout input: hidden [S, B, H] after the final norm."""
        return (hidden if self.config.looped_normed_state  # the block normed it (Ouro)
                else self.decoder.final_layernorm(hidden))

    def _gate(self, normed: Tensor) -> Optional[Tensor]:
        """Exit-gate logits [B, S] of the readout input [S, B, H], None without a gate."""
        return None if self.decoder.exit_gate is None else self.decoder.exit_gate(normed).t()

    def _output_weight(self) -> Tensor:
        """This rank's output rows [V / tp, H]: the output layer's or the tied embedding's."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight

    def loop_weights(self, num_loops: Optional[int] = None) -> Optional[Tensor]:
        """The learned loop credit [R] (``looped_learned_loop_weights``), else None; R =
        ``num_loops`` (None: ``looped_num_loops``)."""
        learned = self.decoder.loop_weights
        return None if learned is None else learned(num_loops or self.config.looped_num_loops)

    def boundary_readouts(self, prefix_state: PrefixState, labels: Tensor,
                          num_loops: Optional[int] = None) -> LoopedOutput:
        """Per-loop log-probs [R, B, 1] of ``labels`` [B] (the first suffix tokens) from the
        readout of the prompt's last position (``prefix_state.boundary``) as ``logprobs``, and
        with the exit gate the exit distribution there as ``exit_logprobs`` [R, B, 1]; R =
        ``num_loops`` (None: the config's), the state's own."""
        config = self.config.with_loops(num_loops)
        self.check_inputs(labels[:, None], None, prefix_state, None, config)
        batch = labels.shape[0]
        first, gate = self._boundary_reads(  # loops play the sequence role: [B, R], [Bp, R]
            prefix_state.boundary,
            lambda rows: self._labels_readout(rows, labels[:, None].expand(batch, len(rows))))
        out = LoopedOutput(logprobs=first.t().unsqueeze(-1))  # [R, B, 1]
        if gate is not None:
            gate = gate.expand(batch, -1).t().unsqueeze(-1)  # [R, B, 1]
            out.exit_logprobs = exit_log_distribution(gate)
        return out

    def _boundary_reads(self, boundary: Tensor, read) -> tuple:
        """``read`` (a readout of loop rows [k, Bp, H] -> ([., k, ...], gate [Bp, k] or None))
        over the per-loop boundary [R, Bp, H], concatenated along the loops (loops play the
        sequence role); the rows of graph-free loops (truncated backprop) under ``no_grad``."""
        frozen = self.config.with_loops(boundary.shape[0]).looped_num_graph_free_loops
        if frozen == 0:
            return read(boundary)
        with torch.no_grad():
            head = read(boundary[:frozen])  # [., R - k, ...], [Bp, R - k]
        tail = read(boundary[frozen:])
        gate = None if tail[1] is None else torch.cat([head[1], tail[1]], dim=1)  # [Bp, R]
        return torch.cat([head[0], tail[0]], dim=1), gate

    def suffix_logprobs(self, prefix_state: PrefixState, tokens: Tensor,
                        labels: Optional[Tensor] = None, num_loops: Optional[int] = None,
                        exit_depths: Optional[Tensor] = None) -> Tensor:
        """Per-loop log-probs [R, B, S] of ``labels`` [B, S] continuing the prompt of
        ``prefix_state``: label 0 from the prompt's boundary readout, label j >= 1 from a
        forward over ``tokens[:, :j]`` (the suffix's inputs, [B, >= S - 1]) against the prefix
        K/V. Default ``labels``: ``tokens`` (the log-probs of the suffix itself). R =
        ``num_loops`` (None: the config's): the count the state was computed with."""
        return self.suffix_readouts(prefix_state, tokens, labels, num_loops,
                                    exit_depths).logprobs

    def suffix_readouts(self, prefix_state: PrefixState, tokens: Tensor,
                        labels: Optional[Tensor] = None, num_loops: Optional[int] = None,
                        exit_depths: Optional[Tensor] = None) -> LoopedOutput:
        """``suffix_logprobs`` as ``logprobs`` [R, B, S], and with the exit gate the exit
        distribution of the same positions as ``exit_logprobs`` [R, B, S]. ``exit_depths``
        [B, >= S - 1]: those of the suffix's input positions (``forward``)."""
        labels = tokens if labels is None else labels
        first = self.boundary_readouts(prefix_state, labels[:, 0], num_loops)  # [R, B, 1]
        S = labels.shape[1]
        if S == 1:
            return first
        rest = self.forward(tokens[:, : S - 1], labels=labels[:, 1:], prefix_state=prefix_state,
                            num_loops=num_loops,
                            exit_depths=None if exit_depths is None else exit_depths[:, : S - 1])
        out = LoopedOutput(logprobs=torch.cat([first.logprobs, rest.logprobs], dim=2))
        if first.exit_logprobs is not None:
            out.exit_logprobs = torch.cat([first.exit_logprobs, rest.exit_logprobs], dim=2)
        return out

    # ---- decoding --------------------------------------------------------------------------

    def new_kv_cache(self, batch: int, max_length: int, prefix: Optional[DepthKVCache] = None,
                     static: Optional[bool] = None,
                     num_loops: Optional[int] = None) -> DepthKVCache:
        """An empty depth-indexed cache in the model's dtype and device, for decoding with
        ``num_loops`` loops (None: ``looped_num_loops``; its prefill and decode steps take the
        same count). ``prefix``: a cache of N prefilled prompts that this cache's ``batch`` =
        N * G rows continue (prompt-once decoding: ``max_length`` then counts only the tokens
        after the prompt). ``static``: see ``DepthKVCache`` (None: static on CUDA)."""
        p = next(self.parameters())
        return DepthKVCache(self.config.with_loops(num_loops), batch, max_length,
                            dtype=p.dtype, device=p.device, prefix=prefix, static=static)

    @torch.no_grad()
    def prefill(self, cache: DepthKVCache, tokens: Tensor, lengths: Tensor,
                with_exit: bool = False, num_loops: Optional[int] = None):
        """Right-padded prompts tokens [B, T] with ``lengths`` [B] -> per-loop logits [R, B, V]
        at each prompt's last token, over the whole (padded) vocabulary on every
        tensor-parallel rank. Padding K/V is written but never attended to. Only each
        prompt's last position is read out (every position would cost R x T x V logits per
        row, more than the layers with a real vocabulary). ``with_exit``:
        (logits, the exit distribution log p(r) [R, B] there; None without a gate).
        ``num_loops``: R (None: the config's), the cache's (``new_kv_cache``)."""
        cache.lengths.zero_()
        config = self.config.with_loops(num_loops)
        self.check_inputs(tokens, None, None, cache, config)
        cache.fresh = cache.prefix is None
        try:
            states, _ = self._loop_states(tokens, None, None, None, cache, False,
                                          num_loops=config.looped_num_loops)  # R x [T, B, H]
        finally:
            cache.fresh = False
        cache.lengths.copy_(lengths)  # host (once per prefill: a copy from the device)
        lengths = lengths.to(tokens.device, non_blocking=True)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        last = [h[lengths - 1, rows][None] for h in states]  # R x [1, B, H]
        out = LoopedOutput()
        self._readout_all(last, None, out)  # only the last prompt position is read out
        logits = self._full_vocab([lg[:, 0] for lg in out.logits])
        if not with_exit:
            return logits  # [R, B, V]
        exit_lp = None if out.exit_logprobs is None else out.exit_logprobs[:, :, 0]
        return logits, exit_lp  # [R, B, V], [R, B]

    @torch.no_grad()
    def extend(self, cache: DepthKVCache, tokens: Tensor, counts: Tensor,
               labels: Optional[Tensor] = None, num_loops: Optional[int] = None) -> tuple:
        """Append ``counts[b]`` tokens to row b of ``cache`` at its current length (one forward:
        a node's tokens prefilled against its cached path, or an environment's reply after an
        answer): tokens [B, s] right-padded, counts [B] long on the host (0 <= counts <= s;
        the padding's K/V is written past the row's new length and never attended to).
        -> (per-loop logits [R, B, V] at each row's last appended token, as ``prefill``; the
        exit distribution there [R, B] or None without a gate; with ``labels`` [B, s] the
        per-loop log-probs [R, B, s] of labels[:, j] after tokens[:, : j + 1], else None). A
        row with count 0 keeps its length and gets meaningless logits."""
        config = self.config.with_loops(num_loops)
        self.check_inputs(tokens, labels, None, cache, config)
        if counts.device.type != "cpu" or tuple(counts.shape) != (tokens.shape[0],):
            raise ValueError(f"extend's counts must be a host tensor [{tokens.shape[0]}] (one "
                             f"per row), got {tuple(counts.shape)} on {counts.device}")
        if int(counts.min()) < 0 or int(counts.max()) > tokens.shape[1]:
            raise ValueError(f"extend's counts must lie in [0, {tokens.shape[1]}] (the tokens' "
                             f"width), got {counts.tolist()}")
        counts = mark_host(counts)
        states, _ = self._loop_states(tokens, None, None, None, cache, False,
                                      num_loops=config.looped_num_loops)  # R x [s, B, H]
        cache.lengths += counts
        last_index = upload((counts - 1).clamp(min=0), tokens.device)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        out = LoopedOutput()
        self._readout_all([h[last_index, rows][None] for h in states], None, out)
        logits = self._full_vocab([lg[:, 0] for lg in out.logits])  # [R, B, V]
        exit_lp = None if out.exit_logprobs is None else out.exit_logprobs[:, :, 0]
        scored = None
        if labels is not None:
            scored = LoopedOutput()
            self._readout_all(states, labels, scored)
            scored = scored.logprobs  # [R, B, s]
        return logits, exit_lp, scored

    @torch.no_grad()
    def decode_step(self, cache: DepthKVCache, tokens: Tensor, with_exit: bool = False,
                    num_loops: Optional[int] = None):
        """Append one token per sequence (tokens [B]) -> per-loop logits [R, B, V] (as
        ``prefill``; ``with_exit``: and the exit distribution log p(r) [R, B], None without a
        gate; ``num_loops``: the cache's R, None: the config's)."""
        self.check_inputs(tokens[:, None], None, None, cache, self.config.with_loops(num_loops))
        logits, exit_lp = self.decode_on_device(cache, tokens, cache.plan(1))
        cache.lengths += 1
        return (logits, exit_lp) if with_exit else logits

    def decode_on_device(self, cache: DepthKVCache, tokens: Tensor, step: CacheStep) -> tuple:
        """The device part of ``decode_step`` (what a CUDA graph captures, ``DecodeGraph``):
        tokens [B] at ``step`` (``cache.plan(1)``) -> (logits [R, B, V], exit distribution
        [R, B] or None) with the cache's loop count; the cache's host ``lengths`` are left
        alone."""
        states, _ = self._loop_states(tokens[:, None], None, None, None, cache, False, step,
                                      cache.num_loops)
        out = LoopedOutput()
        self._readout_all(states, None, out)
        logits = self._full_vocab([lg[:, 0] for lg in out.logits])
        return logits, None if out.exit_logprobs is None else out.exit_logprobs[:, :, 0]

    def _full_vocab(self, per_loop: list) -> Tensor:
        """R tensors [B, V/tp] -> [R, B, V], the same on every tensor-parallel rank."""
        return gather_vocab(torch.stack(per_loop), self.pg_collection.tp)  # [R, B, V]

    # ---- helpers ---------------------------------------------------------------------------

    def _positions(self, input_ids, position_ids, prefix_state, step) -> tuple:
        """-> (absolute positions [B, S] on the device, a bound on them known on the host:
        the RoPE table's rows). Only explicit ``position_ids`` are read on the host."""
        if position_ids is not None:
            span = int(position_ids.max()) + 1 if self.position_embedding_type == "rope" else 0
            return position_ids.expand_as(input_ids), span
        if step is not None:
            return step.positions, step.rope_span
        start = prefix_state.length if prefix_state is not None else 0
        pos = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        return pos[None, :].expand_as(input_ids), start + input_ids.shape[1]

    def _rope(self, positions: Tensor, span: int):
        """RoPE of ``positions`` [B, S] (all < ``span``) -> frequencies [S, B, 1, d], or None;
        recording no graph, their ``RotaryAngles`` (cos and sin once per forward), of one row
        [S, 1, 1, d] where the rows share their positions (``positions`` an expand of one row:
        a forward from position 0 or a prefill of equal rows), broadcast by the rotation: the
        same values, without a product over B rows of angles in every layer application."""
        if self.position_embedding_type != "rope":
            return None
        # one table of at least the model's length: MCore caches it by length (rows do not
        # depend on it), so decode steps and groups of every length reuse it
        table = self.rotary_pos_emb(max(span, self.max_sequence_length))  # [T, 1, 1, d]
        graph = torch.is_grad_enabled()
        if not graph and positions.stride(0) == 0:
            positions = positions[:1]  # [1, S]
        freqs = table[:, 0, 0][positions].transpose(0, 1).unsqueeze(2)  # [S, B or 1, 1, d]
        return freqs if graph else RotaryAngles.of(freqs)

    def _collect_prefix_state(self, ctx: LoopKV, states: list, config) -> PrefixState:
        recorded = [ctx.recorded[d] for d in range(config.looped_num_depths)]
        boundary = torch.stack([h[-1] for h in states])  # [R, B, H]
        if ctx.record_inputs:
            return PrefixState([], [], boundary, state_signature(config), [x for x, in recorded])
        return PrefixState([k for k, _ in recorded], [v for _, v in recorded], boundary,
                           state_signature(config))

    def check_inputs(self, input_ids, labels, prefix_state, kv_cache, config) -> None:
        """The inputs of a call whose config (``with_loops``) is ``config``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        if prefix_state is not None and kv_cache is not None:
            raise ValueError("pass either prefix_state or kv_cache, not both")
        if prefix_state is not None:
            prefix_state.check_compatible(config)
            if prefix_state.batch not in (1, input_ids.shape[0]):
                raise ValueError(f"prefix state batch {prefix_state.batch} must be 1 or the "
                                 f"input batch {input_ids.shape[0]}")
        if kv_cache is not None:
            if kv_cache.signature != state_signature(config):
                raise ValueError("kv_cache was built for a different model config")
            if int(kv_cache.lengths.max()) + input_ids.shape[1] > kv_cache.max_length:  # host
                raise ValueError(f"kv_cache holds {kv_cache.max_length} positions; this step "
                                 f"would write past it")

