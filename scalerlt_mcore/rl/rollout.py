"""Batched rollouts from the looped model with the depth-indexed KV cache.

Samples from the final loop's readout (the number of loops equals training's), with
temperature and top-p, a stop token and a maximum length. Records the policy's log-prob of
every sampled token (temperature 1) under every loop's readout: for comparison with the
training forward, or as the old log-probs of the update.

Two ways to hold the prompts, the same samples (``generate(..., prompt_once=...)``):
- per row: every one of the G samples of a prompt is its own row, the prompt prefilled G times
  and its K/V cached G times;
- prompt once (Hydragen): each prompt prefilled once into a cache of N rows; the G samples
  keep only their own tokens' K/V and read the prompt's single copy through
  ``prompt_once_attention`` (``DepthKVCache(prefix=...)``).

Under tensor parallelism the model returns the whole (padded) vocabulary's logits on every rank
of a TP group and each rank's KV caches (per row, or the prompt-once prefix and continuation)
hold its own heads; ranks that pass the same prompts and generator state draw the same tokens.
Padding ids (>= ``vocab_size``) are never drawn.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Rollout:
    """G responses for each of N prompts.

    prompts:   list of N token lists.
    responses: [N, G, S] long, right-padded with pad_id (eos included when produced).
    lengths:   [N, G] response lengths (eos counted).
    logprobs:  [N, G, S] log-probs of the sampled tokens under the sampled loop's readout
               (0 on padding).
    loop_logprobs: [R, N, G, S] the same under every loop's readout (0 on padding).
    """

    prompts: list
    responses: Tensor
    lengths: Tensor
    logprobs: Tensor
    loop_logprobs: Optional[Tensor] = None


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
    """logits [B, V] -> token ids [B]; temperature 0 is greedy; ``banned`` ids and the padding
    ids >= ``vocab_size`` (Megatron's vocabulary padding) are never drawn. ``generator`` (or
    None: the default one) must be on the logits' device."""
    check_generator(generator, logits.device)
    padded = vocab_size is not None and vocab_size < logits.shape[-1]
    if banned or padded:
        logits = logits.clone()
        logits[:, list(banned)] = float("-inf")
        if padded:
            logits[:, vocab_size:] = float("-inf")
    if temperature == 0:
        return logits.argmax(-1)
    probs = top_p_filter(logits.float() / temperature, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_generator(generator, device: torch.device) -> None:
    """Sampling on ``device`` needs a generator of that device type (or None)."""
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"the sampling generator is on {generator.device}, the logits on "
                         f"{device}: create it with torch.Generator(device=...) on the "
                         f"model's device")


def _right_pad(rows: list, pad_id: int) -> tuple:
    """Host tensors: rows right-padded [B, Tp] and their lengths [B] (moved once by the
    caller)."""
    lengths = torch.tensor([len(r) for r in rows], device="cpu")
    out = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long, device="cpu")
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, device="cpu")
    return out, lengths


@torch.no_grad()
def generate(model, prompts: list, group_size: int, max_new_tokens: int, *, eos_id: int,
             pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
             generator=None, banned=(), loop: int = -1, prompt_once: bool = False,
             vocab_size=None) -> Rollout:
    """Sample ``group_size`` responses per prompt (a list of token lists) from the readout of
    ``loop`` (default the last), with ``generator`` on the model's device. Log-probs are the
    policy's own (temperature 1, no ban, over the model's whole padded vocabulary, as training
    scores them). The returned tensors are on the host (rewards and decoding read them there).
    ``prompt_once``: prefill each prompt once and decode its samples against that one copy (the
    same samples and log-probs up to rounding; rows are ordered as per row). ``vocab_size``: the
    real vocabulary (ids beyond it are padding, never drawn); None: no padding."""
    device = next(model.parameters()).device
    check_generator(generator, device)
    if prompt_once:
        cache, logits = prefill_prompt_once(model, prompts, group_size, max_new_tokens, pad_id)
    else:
        rows = [p for p in prompts for _ in range(group_size)]
        tokens, lengths = _right_pad(rows, pad_id)  # [B, Tp]
        tokens, lengths = tokens.to(device), lengths.to(device)
        cache = model.new_kv_cache(tokens.shape[0], tokens.shape[1] + max_new_tokens)
        logits = model.prefill(cache, tokens, lengths)  # [R, B, V]
    R, B = logits.shape[:2]
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(R, B, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        nxt = sample_next(logits[loop], temperature, top_p, generator, banned, vocab_size)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        picked = lp.gather(-1, nxt[None, :, None].expand(R, -1, 1)).squeeze(-1)  # [R, B]
        logps[:, :, t] = torch.where(done, 0.0, picked.float())
        out[:, t] = nxt
        done |= nxt == eos_id
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        logits = model.decode_step(cache, nxt)
    resp_len = (out != pad_id).sum(-1)  # pad is never sampled (banned by the caller)
    n = len(prompts)
    per_loop = logps.view(R, n, group_size, -1).cpu()  # [R, N, G, S]
    return Rollout(prompts, out.view(n, group_size, -1).cpu(),
                   resp_len.view(n, group_size).cpu(), per_loop[loop], per_loop)


def prefill_prompt_once(model, prompts: list, group_size: int, max_new_tokens: int,
                        pad_id: int) -> tuple:
    """Each of the N prompts prefilled once. -> (a cache for the N * G samples that continue
    them, holding ``max_new_tokens`` of their own; per-loop logits [R, N * G, V] of every
    sample's first token, the prompt's repeated G times)."""
    device = next(model.parameters()).device
    tokens, lengths = _right_pad(prompts, pad_id)  # [N, Tp]
    prefix = model.new_kv_cache(len(prompts), tokens.shape[1])
    logits = model.prefill(prefix, tokens.to(device), lengths.to(device))  # [R, N, V]
    cache = model.new_kv_cache(len(prompts) * group_size, max_new_tokens, prefix=prefix)
    return cache, logits.repeat_interleave(group_size, dim=1)  # [R, N * G, V]
