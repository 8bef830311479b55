"""Batched rollouts from the looped model with the depth-indexed KV cache.

Samples from the final loop's readout (the number of loops equals training's), with
temperature and top-p, a stop token and a maximum length. Records the log-prob of every
sampled token under every loop's readout at the sampling temperature T, log_softmax(logits / T)
(top-p not applied; greedy, T = 0: at T = 1; ``logprob_temperature``), as training scores
them at the same temperature (``LoopedGPTModel.logprobs_at``): for comparison with the
training forward, or as the old log-probs of the update.

With the model's exit gate (``exit_mode``): ``mixture`` samples every token from the
exit-weighted mixture sum_r p(r) pi_r of the loops' readouts, ``threshold`` from the readout
of the first loop whose exit CDF reaches ``exit_threshold`` (per sequence and token, Ouro's
early exit; every loop is still computed, since later tokens attend to every depth's K/V).
The recorded log-prob of a sampled token is then that of the sampling distribution (each
pi_r at the sampling temperature, before top-p): log sum_r p(r) pi_r(y), or log pi_{r*}(y) of
the exit loop r*.

How tokens are drawn is one ``Sampling`` (``generate(..., sampling=Sampling(...))``). Two
ways to hold the prompts, the same samples (``generate(..., prompt_once=...)``):
- per row: every one of the G samples of a prompt is its own row, the prompt prefilled G times
  and its K/V cached G times;
- prompt once (Hydragen): each prompt prefilled once into a cache of N rows; the G samples
  keep only their own tokens' K/V and read the prompt's single copy through
  ``prompt_once_attention`` (``DepthKVCache(prefix=...)``).

Prefix trees (multi-turn and branching rollouts) chain such caches one level per tree depth:
``rl/tree_rollout.py`` (``generate_tree``), sampling through the same ``decode_tokens``.

Under tensor parallelism the model returns the whole (padded) vocabulary's logits on every rank
of a TP group and each rank's KV caches (per row, or the prompt-once prefix and continuation)
hold its own heads; ranks that pass the same prompts and generator state draw the same tokens.
Padding ids (>= ``vocab_size``) are never drawn.

No decoded token waits for the device (``model/host_syncs.py`` counts it): the cache's
positions are known on the host, the banned ids are one device mask built before decoding,
tokens are drawn with ``torch.multinomial``'s own one-sample method without its input check
(which reads a value on the host), and whether every response has stopped is asked every
``stop_check_interval`` tokens (that read waits for the device).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal, Optional, Union, get_args

import torch
from torch import Tensor

from ..model.config import FieldError
from ..model.decode_graph import DecodeGraphs
from ..model.host_syncs import mark_host, upload
from ..model.vocab_parallel import tempered


@dataclass
class Rollout:
    """G responses for each of N prompts.

    prompts:   list of N token lists.
    responses: [N, G, S] long, right-padded with pad_id (eos included when produced).
    lengths:   [N, G] response lengths (eos counted).
    logprobs:  [N, G, S] log-probs of the sampled tokens under the sampling distribution
               (the sampled loop's readout, or with ``exit_mode`` the exit mixture or the exit
               loop's readout; 0 on padding).
    loop_logprobs: [R, N, G, S] the same under every loop's readout (0 on padding).
    exit_logprobs: [R, N, G, S] the exit distribution log p(r) at every sampled token's
               position (exit gate on; 0 on padding), else None.
    exit_loops: [N, G, S] the loop (from 1) whose readout sampled each token with
               ``exit_mode`` threshold (0 on padding), else None.
    exit_depths: [N, G, S] a serving engine's recorded exit depths (1..R, 0 on padding):
               each token was sampled at that loop of the position before it, whose K/V
               stopped there (the training replays both: ``RLGroup.exit_depths``); None:
               every token at full depth.
    """

    prompts: list
    responses: Tensor
    lengths: Tensor
    logprobs: Tensor
    loop_logprobs: Optional[Tensor] = None
    exit_logprobs: Optional[Tensor] = None
    exit_loops: Optional[Tensor] = None
    exit_depths: Optional[Tensor] = None


ExitMode = Literal["none", "mixture", "threshold"]
"""How rollouts use the exit gate: not at all, the exit-weighted mixture, or CDF early exit."""
EXIT_MODES = get_args(ExitMode)


def exit_loop_at(exit_logprobs: Tensor, threshold: float) -> Tensor:
    """The first loop (from 0) whose exit CDF reaches ``threshold``: exit_logprobs [R, B] ->
    [B] (the last loop when rounding keeps the CDF below it)."""
    cdf = exit_logprobs.exp().cumsum(0)  # [R, B]
    return (cdf < threshold).sum(0).clamp(max=exit_logprobs.shape[0] - 1)


STOP_CHECK_INTERVALS = {"cuda": 8}
"""Default ``stop_check_interval`` per device type (1 elsewhere: a read on the host is free)."""


def default_stop_check_interval(device) -> int:
    return STOP_CHECK_INTERVALS.get(torch.device(device).type, 1)


PROMPT_KV = ("shared", "copied")
"""How prompt-once decoding reads each prompt's K/V after prefilling it once: ``shared`` (one
copy per prompt, which its G rows read through a cascade attention of two parts merged by
their log-sum-exps: the prompt's K/V read once per group, what bounds a GPU's decode step) or
``copied`` (the prompt's K/V copied once into each of its G rows' caches, decoded as per row:
one attention part per step, what bounds a host-bound CPU step; ``benchmarks/decode.py``
measures both). The prefill is once per prompt either way."""

PROMPT_KV_BY_DEVICE = {"cpu": "copied"}
"""Default ``prompt_kv`` per device type (``shared`` elsewhere)."""


def default_prompt_kv(device) -> str:
    return PROMPT_KV_BY_DEVICE.get(torch.device(device).type, "shared")


def ban_mask(banned, vocab_size, width: int, device) -> Optional[Tensor]:
    """[width] bool on ``device``, True on the ``banned`` ids and the padding ids >=
    ``vocab_size``; None when nothing is banned. Built once per rollout (no host index tensor
    per token)."""
    banned = () if banned is None else banned
    padded = vocab_size is not None and vocab_size < width
    if not len(banned) and not padded:
        return None
    mask = torch.zeros(width, dtype=torch.bool, device="cpu")
    mask[list(banned)] = True
    if padded:
        mask[vocab_size:] = True
    return upload(mask, device)


def _banned(logits: Tensor, banned, vocab_size) -> Tensor:
    """``logits`` with the banned ids (a ``ban_mask`` or ids) and padding ids at -inf."""
    mask = banned if isinstance(banned, Tensor) else ban_mask(banned, vocab_size,
                                                               logits.shape[-1], logits.device)
    return logits if mask is None else logits.masked_fill(mask, float("-inf"))


def draw(probs: Tensor, generator) -> Tensor:
    """One index per row of ``probs`` [..., V]: ``torch.multinomial(probs, 1)``'s own method
    (exponential race: argmax p / E, E ~ Exp(1)), the same draws from the same generator
    state, without its input check that reads a value on the host."""
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(-1)


def sample_mixture(logits: Tensor, exit_logprobs: Tensor, temperature: float, top_p: float,
                   generator, banned=(), vocab_size=None) -> Tensor:
    """A token per row from sum_r p(r) pi_r: logits [R, B, V], exit_logprobs [R, B] -> [B]
    (each loop's distribution with temperature and top-p; greedy at temperature 0; ``banned``
    and padding ids as in ``sample_next``)."""
    check_generator(generator, logits.device)
    logits = _banned(logits.float(), banned, vocab_size)
    if temperature == 0:
        probs = logits.softmax(-1)
    else:
        probs = top_p_filter(logits / temperature, top_p).softmax(-1)  # [R, B, V]
    mixture = (exit_logprobs.float().exp()[..., None] * probs).sum(0)  # [B, V]
    if temperature == 0:
        return mixture.argmax(-1)
    return draw(mixture, generator)


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Mask (to -inf) tokens outside the smallest set whose probability reaches ``top_p``."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_next(logits: Tensor, temperature: float, top_p: float, generator,
                banned=(), vocab_size=None) -> Tensor:
    """logits [B, V] -> token ids [B]; temperature 0 is greedy; ``banned`` ids (or their
    ``ban_mask``) and the padding ids >= ``vocab_size`` (Megatron's vocabulary padding) are
    never drawn. ``generator`` (or None: the default one) must be on the logits' device."""
    check_generator(generator, logits.device)
    logits = _banned(logits, banned, vocab_size)
    if temperature == 0:
        return logits.argmax(-1)
    probs = top_p_filter(logits.float() / temperature, top_p).softmax(-1)
    return draw(probs, generator)


def check_generator(generator, device: torch.device) -> None:
    """Sampling on ``device`` needs a generator of that device type (or None)."""
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"the sampling generator is on {generator.device}, the logits on "
                         f"{device}: create it with torch.Generator(device=...) on the "
                         f"model's device")


def right_pad(rows: list, pad_id: int, width: Optional[int] = None) -> tuple:
    """Host tensors: rows right-padded [B, Tp] and their lengths [B] (moved once by the
    caller); Tp: ``width`` (None: the longest row)."""
    lengths = mark_host(torch.tensor([len(r) for r in rows], device="cpu"))
    width = width or int(lengths.max())
    out = torch.full((len(rows), width), pad_id, dtype=torch.long, device="cpu")
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, device="cpu")
    return out, lengths


@dataclass(frozen=True)
class Sampling:
    """How ``generate`` and ``generate_tree`` draw tokens, the one route of the sampling
    settings: ``temperature`` (0: greedy) and ``top_p``, from ``generator`` (on the model's
    device; None: the default one), never an id of ``banned`` (ids, or their ``ban_mask``) nor
    a padding id >= ``vocab_size`` (Megatron's vocabulary padding; None: none), from the
    readout of ``loop`` (default the last) or, with ``exit_mode`` (``EXIT_MODES``; needs the
    exit gate), from the exit mixture or the first loop whose exit CDF reaches
    ``exit_threshold``; whether every response has stopped is asked every
    ``stop_check_interval`` tokens (None: by device). Checks itself (a ``FieldError``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    generator: Optional[torch.Generator] = None
    banned: Union[Sequence[int], Tensor, None] = ()
    vocab_size: Optional[int] = None
    loop: int = -1
    exit_mode: ExitMode = "none"
    exit_threshold: float = 0.5
    stop_check_interval: Optional[int] = None
    exit_kv: bool = False
    """With ``exit_mode`` threshold: the position that sampled a token at loop e keeps loop
    e's K/V at every deeper loop (``DepthKVCache.keep_exits``), as a serving engine that
    exits early keeps it (vllm-rlt's ``last_exited``): the K/V its records' exit depths
    replay (``Rollout.exit_depths``). False: every position's K/V of every loop."""

    def __post_init__(self):
        if self.temperature < 0:
            raise FieldError("temperature", f"must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.exit_mode not in EXIT_MODES:
            raise FieldError("exit_mode", f"must be one of {EXIT_MODES}, got {self.exit_mode!r}")
        if not 0 < self.exit_threshold <= 1:
            raise FieldError("exit_threshold", f"must be in (0, 1], got {self.exit_threshold}")
        if self.exit_kv and self.exit_mode != "threshold":
            raise FieldError("exit_kv", f"needs exit_mode threshold, got {self.exit_mode!r}")
        if self.stop_check_interval is not None and self.stop_check_interval < 1:
            raise FieldError("stop_check_interval",
                             f"must be >= 1 or None, got {self.stop_check_interval}")

    def on(self, width: int, device) -> "Sampling":
        """This sampling for logits of ``width`` ids on ``device``: ``banned`` and the padding
        ids as one ``ban_mask`` (built once per rollout, no host index tensor per token), the
        device's ``stop_check_interval`` where None."""
        every = self.stop_check_interval or default_stop_check_interval(device)
        return replace(self, banned=ban_mask(self.banned, self.vocab_size, width, device),
                       vocab_size=None, stop_check_interval=every)


@torch.no_grad()
def generate(model, prompts: list, group_size: int, max_new_tokens: int, *, eos_id: int,
             pad_id: int, sampling: Optional[Sampling] = None, prompt_once: bool = False,
             static_cache: Optional[bool] = None,
             cuda_graph: Union[bool, DecodeGraphs] = False, num_loops: Optional[int] = None,
             prompt_kv: Optional[str] = None, max_rows: Optional[int] = None) -> Rollout:
    """Sample ``group_size`` responses per prompt (a list of token lists) as ``sampling`` says
    (a ``Sampling``; None: its defaults). Log-probs at the sampling temperature (greedy: 1; no
    top-p, no ban, over the whole padded vocabulary, as training scores them). The returned
    tensors are on the host (rewards and decoding read them there). ``prompt_once``: prefill
    each prompt once and decode its samples against that one copy (the same samples and
    log-probs up to rounding; rows are ordered as per row); ``prompt_kv`` (``PROMPT_KV``;
    None: by device) how its samples read the prompt's K/V. ``num_loops``: R of the decoding
    (None: the config's ``looped_num_loops``). ``cuda_graph``: decode steps replay a CUDA
    graph, captured for this call (True) or kept across calls (``DecodeGraphs``).
    ``max_rows``: the most samples decoded at once (``decode_pieces``; None: all), which
    bounds the K/V cache; the samples drawn in turn from one generator."""
    sampling = sampling or Sampling()
    cuda_graph = DecodeGraphs() if cuda_graph is True else cuda_graph  # one for every call
    if max_rows is None or len(prompts) * group_size <= max_rows:
        return _generate(model, prompts, group_size, max_new_tokens, eos_id, pad_id, sampling,
                         prompt_once, static_cache, cuda_graph, num_loops, prompt_kv)
    parts = [[_generate(model, prompts[first:last], g, max_new_tokens, eos_id, pad_id,
                        sampling, prompt_once, static_cache, cuda_graph, num_loops, prompt_kv)
              for g in samples] for first, last, samples in decode_pieces(
                  len(prompts), group_size, max_rows)]
    return join_rollouts([join_rollouts(p, group_axis=True) for p in parts])


def decode_pieces(num_prompts: int, group_size: int, max_rows: int) -> list:
    """How ``generate`` splits N prompts x G samples into calls of at most ``max_rows`` rows:
    (first prompt, end prompt, [samples per call]); whole groups together where ``max_rows``
    holds one or more, else each prompt's samples ``max_rows`` at a time."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if max_rows >= group_size:
        step = max_rows // group_size
        return [(i, min(i + step, num_prompts), [group_size])
                for i in range(0, num_prompts, step)]
    samples = [min(max_rows, group_size - g) for g in range(0, group_size, max_rows)]
    return [(i, i + 1, samples) for i in range(num_prompts)]


def join_rollouts(parts: list, group_axis: bool = False) -> Rollout:
    """One ``Rollout`` of ``parts`` decoded in turn: their prompts one after another, or
    (``group_axis``) more samples of the same prompts."""
    if len(parts) == 1:
        return parts[0]
    axis = int(group_axis)  # [N, G, ...]; per-loop fields [R, N, G, ...] one further

    def cat(name: str, loop_first: bool = False):
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values, axis + loop_first)

    return Rollout(parts[0].prompts if group_axis else [q for p in parts for q in p.prompts],
                   cat("responses"), cat("lengths"), cat("logprobs"),
                   cat("loop_logprobs", True), cat("exit_logprobs", True), cat("exit_loops"),
                   cat("exit_depths"))


def _generate(model, prompts: list, group_size: int, max_new_tokens: int, eos_id: int,
              pad_id: int, sampling: Sampling, prompt_once: bool, static_cache, cuda_graph,
              num_loops: Optional[int], prompt_kv: Optional[str]) -> Rollout:
    """``generate``'s one call: every sample of ``prompts`` decoded at once."""
    device = next(model.parameters()).device
    check_generator(sampling.generator, device)
    prompt_kv = prompt_kv or default_prompt_kv(device)
    if prompt_kv not in PROMPT_KV:
        raise ValueError(f"prompt_kv must be one of {PROMPT_KV} or None, got {prompt_kv!r}")
    graphs = DecodeGraphs() if cuda_graph is True else (cuda_graph or None)
    shape = (prompt_once, prompt_kv, len(prompts), group_size, max_new_tokens, num_loops)
    width, key, new_cache = _cache_route(model, prompts, graphs, static_cache, shape)
    if prompt_once:
        cache, logits, exit_lp = prefill_prompt_once(model, prompts, group_size,
                                                     max_new_tokens, pad_id, static_cache,
                                                     num_loops, prompt_kv, width, new_cache)
    else:
        rows = [p for p in prompts for _ in range(group_size)]
        tokens, lengths = right_pad(rows, pad_id, width)  # [B, Tp] host
        cache = new_cache(tokens.shape[0], tokens.shape[1] + max_new_tokens,
                          static=static_cache, num_loops=num_loops)
        logits, exit_lp = model.prefill(cache, upload(tokens, device), lengths, with_exit=True,
                                        num_loops=num_loops)  # [R, B, V]
    check_exit_gate(sampling, exit_lp)
    step = (graphs.step(model, key, cache) if graphs is not None
            else partial(model.decode_step, cache, with_exit=True, num_loops=num_loops))
    rec = DecodeRecord(logits.shape[0], logits.shape[1], max_new_tokens, pad_id, eos_id, device,
                  exit_lp is not None)
    keep = partial(cache.keep_exits, model.config) if sampling.exit_kv else None
    decode_tokens(step, logits, exit_lp, rec, max_new_tokens,
                  sampling.on(logits.shape[-1], device), keep)
    return rec.rollout(prompts, group_size, sampling.exit_mode, sampling.exit_kv)


def _cache_route(model, prompts: list, graphs: Optional[DecodeGraphs], static_cache,
                 shape: tuple) -> tuple:
    """Where ``generate``'s caches come from -> (the prompts' padded width, the graph key,
    a ``new_kv_cache``): the model, or with ``graphs`` the caches kept for the rollout's
    ``shape`` (ending in the new tokens and loops), the prompt width rounded up
    (``DecodeGraphs.room``) within the model's positions."""
    width = max(len(p) for p in prompts)
    if graphs is None:
        return width, None, model.new_kv_cache
    if static_cache is False:
        raise ValueError("cuda_graph decoding needs static caches (static_cache True or None)")
    width = max(width, min(graphs.room(width), model.max_sequence_length - shape[-2]))
    key = (id(model), width, *shape)
    return width, key, graphs.cache_maker(model, key)


def check_exit_gate(sampling: Sampling, exit_lp: Optional[Tensor]) -> None:
    """An ``exit_mode`` needs the model's exit gate (``exit_lp``, the exit distribution)."""
    if sampling.exit_mode != "none" and exit_lp is None:
        raise ValueError(f"exit_mode {sampling.exit_mode!r} needs the model's exit gate "
                         f"(looped_exit_gate)")


def decode_tokens(step, logits: Tensor, exit_lp: Optional[Tensor], rec: "DecodeRecord",
                  steps: int, sampling: Sampling, keep=None) -> int:
    """Sample up to ``steps`` tokens per row into ``rec`` from the first token's logits
    [R, B, V] (and exit distribution [R, B] or None), feeding each sampled token but the
    last through ``step(tokens) -> (logits, exit_lp)``; stops early once every row is done,
    asked every ``stop_check_interval`` tokens (``sampling``: ``Sampling.on`` the logits'
    device). ``keep(loops)``: called with each decoded position's exit loops [B] (from 1)
    before the next step reads it (``Sampling.exit_kv``; the prompt runs every loop). -> the
    number of tokens fed (each row's cache grew by it)."""
    s, every = sampling, sampling.stop_check_interval
    rows_index = torch.arange(logits.shape[1], device=logits.device)
    for t in range(steps):
        chosen = None if s.exit_mode != "threshold" else exit_loop_at(exit_lp, s.exit_threshold)
        if keep is not None and t > 0:
            keep(chosen + 1)
        if s.exit_mode == "mixture":
            nxt = sample_mixture(logits, exit_lp, s.temperature, s.top_p, s.generator, s.banned)
        else:
            rows = logits[s.loop] if chosen is None else logits[chosen, rows_index]  # [B, V]
            nxt = sample_next(rows, s.temperature, s.top_p, s.generator, s.banned)
        rec.add(t, nxt, logits, exit_lp, s.exit_mode, chosen, s.loop, s.temperature)
        if t == steps - 1 or ((t + 1) % every == 0 and bool(rec.done.all())):
            return t
        logits, exit_lp = step(rec.out[:, t])
    return 0


class DecodeRecord:
    """What ``generate`` records per decoding step, on the model's device."""

    def __init__(self, R: int, B: int, steps: int, pad_id: int, eos_id: int, device,
                 gated: bool):
        self.pad_id, self.eos_id = pad_id, eos_id
        self.out = torch.full((B, steps), pad_id, dtype=torch.long, device=device)
        self.loops = torch.zeros(R, B, steps, dtype=torch.float32, device=device)
        self.sampled = torch.zeros(B, steps, dtype=torch.float32, device=device)
        self.exits = None
        if gated:
            self.exits = torch.zeros(R, B, steps, dtype=torch.float32, device=device)
        self.exit_loop = torch.zeros(B, steps, dtype=torch.long, device=device)
        self.done = torch.zeros(B, dtype=torch.bool, device=device)

    def add(self, t: int, nxt, logits, exit_lp, exit_mode: str, chosen, loop: int,
            temperature: float = 1.0) -> None:
        """Token ``t`` of every row: ``nxt`` [B] sampled from ``logits`` [R, B, V] at
        ``temperature``, recorded with its log-probs at that temperature (as training scores
        them, ``token_logprobs``)."""
        nxt = torch.where(self.done, torch.full_like(nxt, self.pad_id), nxt)
        R = logits.shape[0]
        lp = torch.log_softmax(tempered(logits, temperature), -1)  # [R, B, V], all of V
        picked = lp.gather(-1, nxt[None, :, None].expand(R, -1, 1)).squeeze(-1)  # [R, B]
        if exit_mode == "mixture":
            sampled = torch.logsumexp(exit_lp.to(picked.dtype) + picked, dim=0)  # [B]
        elif exit_mode == "threshold":
            sampled = picked.gather(0, chosen[None]).squeeze(0)  # [B]
            self.exit_loop[:, t] = torch.where(self.done, 0, chosen + 1)
        else:
            sampled = picked[loop]
        self.loops[:, :, t] = torch.where(self.done, 0.0, picked.float())
        self.sampled[:, t] = torch.where(self.done, 0.0, sampled.float())
        if self.exits is not None:
            self.exits[:, :, t] = torch.where(self.done, 0.0, exit_lp.float())
        self.out[:, t] = nxt
        self.done |= nxt == self.eos_id

    def rollout(self, prompts: list, group_size: int, exit_mode: str,
                exit_kv: bool = False) -> Rollout:
        n, R = len(prompts), self.loops.shape[0]
        resp_len = (self.out != self.pad_id).sum(-1)  # pad is never sampled (banned)
        exits = None if self.exits is None else self.exits.view(R, n, group_size, -1).cpu()
        exit_loops = (self.exit_loop.view(n, group_size, -1).cpu()
                      if exit_mode == "threshold" else None)
        return Rollout(prompts, self.out.view(n, group_size, -1).cpu(),
                       resp_len.view(n, group_size).cpu(),
                       self.sampled.view(n, group_size, -1).cpu(),
                       self.loops.view(R, n, group_size, -1).cpu(), exits, exit_loops,
                       exit_loops if exit_kv else None)


def prefill_prompt_once(model, prompts: list, group_size: int, max_new_tokens: int,
                        pad_id: int, static: Optional[bool] = None,
                        num_loops: Optional[int] = None, prompt_kv: str = "shared",
                        width: Optional[int] = None, new_cache=None) -> tuple:
    """Each of the N prompts prefilled once. -> (a cache for the N * G samples that continue
    them, holding ``max_new_tokens`` of their own; per-loop logits [R, N * G, V] of every
    sample's first token, the prompt's repeated G times; their exit distribution [R, N * G]
    or None without a gate). ``static``: the caches' ``static`` (``DepthKVCache``).
    ``prompt_kv`` (``PROMPT_KV``): ``shared``, the cache continues the prompts' cache;
    ``copied``, it is a per-row cache holding each prompt's K/V in its G rows. ``width``:
    the prompts' padded width (None: the longest); ``new_cache``: makes the caches (None:
    ``model.new_kv_cache``)."""
    device = next(model.parameters()).device
    new_cache = new_cache or model.new_kv_cache
    tokens, lengths = right_pad(prompts, pad_id, width)  # [N, Tp] host
    prefix = new_cache(len(prompts), tokens.shape[1], static=static, num_loops=num_loops)
    logits, exit_lp = model.prefill(prefix, upload(tokens, device), lengths, with_exit=True,
                                    num_loops=num_loops)  # [R, N, V], [R, N]
    if prompt_kv == "copied":
        cache = new_cache(len(prompts) * group_size, prefix.max_length + max_new_tokens,
                          static=static, num_loops=num_loops)
        cache.copy_rows_of(prefix)
    else:
        cache = new_cache(len(prompts) * group_size, max_new_tokens, prefix=prefix,
                          static=static, num_loops=num_loops)
    if exit_lp is not None:
        exit_lp = exit_lp.repeat_interleave(group_size, dim=1)  # [R, N * G]
    return cache, logits.repeat_interleave(group_size, dim=1), exit_lp  # [R, N * G, V]
