"""Naive training for comparison: every response a full prompt+response sequence through
stock MCore ``get_forward_backward_func()``, with the same group-normalised RL loss."""

from functools import partial

from megatron.core.pipeline_parallel import get_forward_backward_func

from .group import SharedPrefixGroup
from .objective import RLObjective


def naive_microbatches(groups: list, objective: RLObjective, micro_batch_size: int) -> list:
    """Split every group into microbatches of full sequences; token weights come from the
    whole group, so the summed loss equals the joint replay's."""
    out = []
    for g in groups:
        weights = objective.token_weights(g.loss_mask)  # [G, T]
        for idx in torch_chunks(g.group_size, micro_batch_size):
            ref = g.ref_logprobs[:, idx] if g.ref_logprobs is not None else None
            out.append({"tokens": g.tokens[idx], "labels": g.labels[idx],
                        "weights": weights[idx], "advantages": g.advantages[idx],
                        "old_logprobs": g.old_logprobs[:, idx], "ref_logprobs": ref})
    return out


def torch_chunks(n: int, size: int) -> list:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def _loss_func(objective, batch, scale, logprobs):
    loss, stats = objective.loss(logprobs, batch["old_logprobs"], batch["advantages"],
                                 batch["weights"], batch["ref_logprobs"])
    return loss * scale, {"loss": loss.detach(), **stats}


def _forward_step(objective, scale, data_iterator, model):
    batch = next(data_iterator)
    logprobs = model(batch["tokens"], labels=batch["labels"]).logprobs  # [R, b, T]
    return logprobs, partial(_loss_func, objective, batch, scale)


def naive_step(model, groups: list, objective: RLObjective, micro_batch_size: int,
               forward_only: bool = False) -> list:
    """One training step of the groups through the stock MCore schedule."""
    if not all(isinstance(g, SharedPrefixGroup) for g in groups):
        raise TypeError("naive_step takes SharedPrefixGroup objects")
    batches = naive_microbatches(groups, objective, micro_batch_size)
    # MCore divides every microbatch loss by their number; the objective is a mean over groups.
    scale = len(batches) / len(groups)
    seq = groups[0].tokens.shape[1]
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, objective, scale),
        data_iterator=iter(batches), model=model, num_microbatches=len(batches),
        seq_length=seq, micro_batch_size=micro_batch_size, forward_only=forward_only,
    )
