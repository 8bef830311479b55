"""A per-wave ``forward_step_func`` for scoring: per-loop log-probs, no loss."""

import torch


def _logprobs_loss(output: torch.Tensor, non_loss_data: bool = False):
    logprobs = output.detach()
    if non_loss_data:
        return logprobs
    return output.new_zeros(()), {"logprobs": logprobs}


def logprobs_forward_step(data_iterator, model):
    """``(logprobs [R, W, T], loss_func)`` for a wave: with ``forward_only`` the schedule's
    result per group holds its log-probs [R, G, T] (under ``"logprobs"``, or as the value with
    ``collect_non_loss_data``)."""
    wave = next(data_iterator)
    return model(wave), _logprobs_loss
