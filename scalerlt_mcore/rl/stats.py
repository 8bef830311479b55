"""The metrics of an RL step computed from its rollout and from the schedule's results."""

import torch

from .batch import trained_masks


def summarise(out: list, num_groups: int) -> dict:
    """Mean group loss (with a per-token loss's [sum, count] reports: the token mean of the
    microbatches), and clip fraction and k3 KL per response token, from either schedule's
    per-microbatch dicts of sums (joint replay: one per group; naive: one per microbatch).
    Per-token reports also give their sums (``loss_token_sum``, ``loss_tokens``), from which a
    mean over ranks is the step's token mean (``step_token_mean``)."""
    first, pair = out[0]["loss"], {}
    if torch.is_tensor(first) and first.numel() == 2:  # per-token: MCore's reporting form
        pairs = torch.stack([o["loss"].detach().double() for o in out]).sum(0)
        loss = float(pairs[0] / pairs[1])
        pair = {"loss_token_sum": float(pairs[0]), "loss_tokens": float(pairs[1])}
    else:
        loss = sum(float(o["loss"]) for o in out) / num_groups
    tokens = sum(float(o["tokens"]) for o in out)
    clip = sum(float(o["clipped"]) for o in out) / tokens
    kl = sum(float(o["kl"]) for o in out) / tokens
    result = {"loss": loss, "clip_fraction": clip, "kl": kl, **pair, **_plans(out)}
    for key in ("exit_loop", "exit_entropy", "is_weight", "is_truncated"):  # means per token
        if key in out[0]:
            result[key] = sum(float(o[key]) for o in out) / tokens
    return result


def _plans(out: list) -> dict:
    """The shared-prefix schedule's per-group plans, as means over the groups."""
    if not out or "wave_size" not in out[0]:
        return {}
    return {f"plan_{k}": sum(float(o[k]) for o in out) / len(out)
            for k in ("wave_size", "retain", "naive", "prompt_segments", "state_inputs")}


def rollout_metrics(rewards, ro) -> dict:
    """The rollout's metrics: mean and std of its rewards [N, G], mean response length, the
    sampled tokens' entropy estimate (``sampled_entropy``) and, with the exit gate, its exit
    loops (``rollout_exit_metrics``)."""
    return {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
            "response_length": ro.lengths.float().mean().item(),
            "entropy": sampled_entropy(ro), **rollout_exit_metrics(ro)}


def rollout_exit_metrics(ro) -> dict:
    """With the exit gate: the rollout's mean exit loop sum_r r p(r) over its sampled tokens,
    and with threshold exits the mean loop that sampled them (loops counted from 1)."""
    if ro.exit_logprobs is None:
        return {}
    S = ro.responses.shape[-1]
    sampled = torch.arange(S, device="cpu")[None, None] < ro.lengths[..., None]  # [N, G, S]
    p = ro.exit_logprobs.exp()  # [R, N, G, S]
    r = torch.arange(1, p.shape[0] + 1, dtype=p.dtype, device="cpu")[:, None, None, None]
    out = {"rollout_exit_loop": float((r * p).sum(0)[sampled].mean())}
    if ro.exit_loops is not None:
        out["rollout_sampled_loop"] = float(ro.exit_loops[sampled].float().mean())
    return out


def sampled_entropy(ro) -> float:
    """Mean -log p of the sampled response tokens under the sampling distribution (the
    policy at the sampling temperature, as rollouts record it): an unbiased estimate of that
    distribution's per-token entropy when top-p is 1; falling towards 0 is entropy collapse."""
    return float(-ro.logprobs.double().sum() / ro.lengths.sum())


def tree_rollout_metrics(rewards, trees: list, node_logprobs: list) -> dict:
    """The metrics of a tree rollout: mean and std of its leaves' rewards (every leaf), the mean
    length of the model's answers (the trained tokens of each node that has any) and the
    sampled-entropy estimate over them (final loop; ``node_logprobs`` [N] x per node
    [R, L_n])."""
    lengths, logp = [], 0.0
    for segments, lps in zip(trees, node_logprobs):
        masks = trained_masks(segments)
        for n in range(1, len(segments)):
            lp, trained = lps[n], masks[n]
            if trained.any():
                lengths.append(float(trained.sum()))
                logp += float(lp[-1].double().cpu()[trained].sum())
    return {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
            "response_length": sum(lengths) / max(len(lengths), 1),
            "entropy": -logp / max(sum(lengths), 1.0)}

