"""Batched rollouts from the looped model with the depth-indexed KV cache.

Samples from the final loop's readout (the number of loops equals training's), with
temperature and top-p, a stop token and a maximum length. Records the policy's log-prob of
every sampled token (temperature 1, final loop) for comparison with the training forward.

Under tensor parallelism the model returns the whole (padded) vocabulary's logits on every rank
of a TP group and each rank's KV cache holds its own heads; ranks that pass the same prompts and
generator state draw the same tokens. Padding ids (>= ``vocab_size``) are never drawn.
"""

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Rollout:
    """G responses for each of N prompts.

    prompts:   list of N token lists.
    responses: [N, G, S] long, right-padded with pad_id (eos included when produced).
    lengths:   [N, G] response lengths (eos counted).
    logprobs:  [N, G, S] final-loop log-probs of the sampled tokens (0 on padding).
    """

    prompts: list
    responses: Tensor
    lengths: Tensor
    logprobs: Tensor


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
    ids >= ``vocab_size`` (Megatron's vocabulary padding) are never drawn."""
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


def _right_pad(rows: list, pad_id: int) -> tuple:
    lengths = torch.tensor([len(r) for r in rows])
    out = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out, lengths


@torch.no_grad()
def generate(model, prompts: list, group_size: int, max_new_tokens: int, *, eos_id: int,
             pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
             generator=None, banned=(), loop: int = -1, vocab_size=None) -> Rollout:
    """Sample ``group_size`` responses per prompt (a list of token lists) from the readout of
    ``loop`` (default the last). Log-probs are the policy's own (temperature 1, no ban, over the
    model's whole padded vocabulary, as training scores them). ``vocab_size``: the real
    vocabulary (ids beyond it are padding, never drawn); None: no padding."""
    rows = [p for p in prompts for _ in range(group_size)]
    tokens, lengths = _right_pad(rows, pad_id)  # [B, Tp]
    device = next(model.parameters()).device
    tokens, lengths = tokens.to(device), lengths.to(device)
    B = tokens.shape[0]
    cache = model.new_kv_cache(B, tokens.shape[1] + max_new_tokens)
    logits = model.prefill(cache, tokens, lengths)[loop]  # [B, V]
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_p, generator, banned, vocab_size)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        logps[:, t] = torch.where(done, 0.0, lp.gather(-1, nxt[:, None]).squeeze(-1).float())
        out[:, t] = nxt
        done |= nxt == eos_id
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        logits = model.decode_step(cache, nxt)[loop]
    resp_len = (out != pad_id).sum(-1)  # pad is never sampled (banned by the caller)
    n = len(prompts)
    return Rollout(prompts, out.view(n, group_size, -1).cpu(),
                   resp_len.view(n, group_size).cpu(), logps.view(n, group_size, -1).cpu())
