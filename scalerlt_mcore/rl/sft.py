"""The supervised warm-up: gold (prompt, answer) pairs as one padded batch, and its loss.

The batch goes through stock MCore ``get_forward_backward_func()``; the loss is the per-loop
weighted token-mean NLL of the answer tokens, with the warm-up weights of the objective's loop
credit (``loop_credit.warmup_weights``) and, with the exit gate, the gate's own objective.
"""

from functools import partial

import torch
from megatron.core.utils import unwrap_model

from ..shared_prefix.naive import readout_dict
from .loop_credit import warmup_weights


def sft_batch(prompts: list, answers: list, pad_id: int, device=None) -> dict:
    """Warm-up batch on ``device``: tokens/labels [N, T] right-padded with ``pad_id``; mask
    [N, T] on the positions that predict the answer. Built on the host, moved once."""
    T = max(len(p) + len(a) for p, a in zip(prompts, answers))
    tokens = torch.full((len(prompts), T), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros(len(prompts), T, device="cpu")
    for i, (p, a) in enumerate(zip(prompts, answers)):
        tokens[i, : len(p) + len(a)] = torch.tensor(p + a, device="cpu")
        mask[i, len(p) - 1 : len(p) - 1 + len(a)] = 1
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = tokens[:, 1:]
    return {"tokens": tokens.to(device), "labels": labels.to(device), "mask": mask.to(device)}


def sft_loss(scheme: str, mask, output, objective=None, per_token: bool = False):
    """Per-loop-weighted token-mean NLL; ``output``: logprobs [R, N, T] or a dict of them with
    ``exit_logprobs`` [R, N, T] and ``loop_weights`` [R]; mask [N, T]. The loop weights
    are the warm-up weights of loop credit ``scheme`` (``loop_credit.warmup_weights``: learned
    credit its weights, exit_pdf uniform ones).
    With ``objective.exit_gate_coef`` the gate's own objective is added over the answer tokens (the
    per-token NLL as its loss), so the gate trains, and receives a gradient, every step.
    ``per_token`` (MCore's ``calculate_per_token_loss``): (the token sum, the answer tokens,
    stats), so that MCore divides by the step's answer tokens over every rank."""
    out = output if isinstance(output, dict) else {"logprobs": output}
    logprobs = out["logprobs"]
    dt = logprobs.dtype
    w = warmup_weights(scheme, out, logprobs)  # [R, 1, 1]
    nll_sum = -(w * logprobs * mask.to(dt)).sum()
    nll = nll_sum / mask.sum()
    total = nll_sum if per_token else nll
    if objective is not None and objective.exit_gate_coef > 0:
        weights = mask.to(logprobs.dtype) / (1 if per_token else mask.sum())  # [N, T]
        gate = objective.gate_objective(out.get("exit_logprobs"), -logprobs, weights)
        total = total + objective.exit_gate_coef * gate
    if per_token:
        return total, (mask != 0).sum().to(torch.int), {"nll": nll.detach()}
    return total, {"nll": nll.detach()}


def sft_forward_step(objective, data_iterator, model, num_loops=None):
    """MCore ``forward_step_func`` of the warm-up: the batch's per-loop log-probs (and the
    model's exit log-probs and learned loop weights, when it has them) and ``sft_loss`` (a
    token sum with the config's ``calculate_per_token_loss``); ``num_loops``: R of the step
    (None: the config's)."""
    batch = next(data_iterator)
    out = model(batch["tokens"], labels=batch["labels"], num_loops=num_loops)  # [R, N, T]
    output = readout_dict(unwrap_model(model), out.logprobs.shape[0], out.logprobs,
                          out.exit_logprobs)
    per_token = bool(getattr(unwrap_model(model).config, "calculate_per_token_loss", False))
    return output, partial(sft_loss, objective.loop_weights, batch["mask"], objective=objective,
                           per_token=per_token)
