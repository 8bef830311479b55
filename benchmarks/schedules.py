"""The training schedules under comparison, each one full step (forward + backward) of one
GRPO group that leaves the parameter gradients in ``p.grad`` and returns the group loss.

- ``naive``: every response a full prompt+response sequence, all G in one microbatch through
  stock MCore ``get_forward_backward_func()``;
- ``naive_mb1``: the same with one response per microbatch (G microbatches: MCore's usual
  gradient accumulation, which holds one sequence's activations at a time);
- ``tree``: prompt + G responses packed into one sequence of P + G*S tokens with a prefix-tree
  attention mask and position ids restarting at P for every response (verl / OpenPipe ART);
- ``joint`` / ``joint_ckpt`` / ``joint_concat``: shared-prefix joint replay with cascade prefix
  attention, the same with per-wave checkpointing, and with the prefix K/V concatenated per
  response instead (``looped_prefix_attention='concat'``);
- ``joint_retain``: joint replay whose prompt producer keeps its graph (prompt computed once);
- ``auto``: the schedule's planner picks joint replay (retain where it fits) or naive (all G in
  one microbatch) for the group from a cost model calibrated on the model.
"""

import contextlib
from functools import partial

import torch

from scalerlt_mcore.model.vocab_parallel import token_logprobs
from scalerlt_mcore.rl.objective import RLObjective, rl_forward_step
from scalerlt_mcore.shared_prefix import (
    SharedPrefixGroup,
    get_shared_prefix_forward_backward_func,
    naive_step,
)
from scalerlt_mcore.shared_prefix.planner import CostModel, Planner

SCHEDULES = ("naive", "naive_mb1", "tree", "joint", "joint_retain", "joint_ckpt", "joint_concat",
             "auto")
JOINT_VARIANTS = ("joint", "joint_retain", "joint_ckpt", "joint_concat")
VARIANTS = ("joint_retain", "auto")
"""The variant rows (retained prompt graph, the planner's choice), which a workload may leave
out (``Workload.variants``)."""


# ---- naive: the project's naive step (stock MCore schedule over full sequences) -----------

def step_loss(outputs: list) -> torch.Tensor:
    """The step's loss from a schedule's per-microbatch results (token weights come from the
    whole group, so the sum of the microbatches' parts equals joint replay's loss)."""
    return sum(o["loss"] for o in outputs)


# ---- packed tree mask: one sequence, prefix once, each response sees prompt + itself --------

def tree_inputs(group: SharedPrefixGroup) -> dict:
    """Packed tokens [1, L], position ids [1, L], MCore mask [1, 1, L, L] (True = masked), and
    for every response the packed positions [G, S + 1] that predict labels[:, P - 1:]."""
    P, (G, T) = group.prompt_length, group.tokens.shape
    S, dev = T - P, group.tokens.device
    tokens = torch.cat([group.tokens[0, :P], group.tokens[:, P:].reshape(-1)])[None]  # [1, L]
    offsets = torch.arange(S, device=dev)
    positions = torch.cat([torch.arange(P, device=dev), (P + offsets).repeat(G)])[None]
    segment = torch.cat([torch.full((P,), -1, device=dev),
                         torch.arange(G, device=dev).repeat_interleave(S)])  # [L]: -1 = prompt
    L = segment.shape[0]
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    same = (segment[None, :] == -1) | (segment[None, :] == segment[:, None])  # key visible
    mask = ~(causal & same)[None, None]  # [1, 1, L, L]
    starts = P + S * torch.arange(G, device=dev)  # packed index of each response's token 0
    index = torch.empty(G, S + 1, dtype=torch.long, device=dev)
    index[:, 0] = P - 1  # the first response token is predicted from the last prompt position
    index[:, 1:] = starts[:, None] + offsets[None, :]  # token j >= 1 from response token j - 1
    return {"tokens": tokens, "positions": positions, "mask": mask, "index": index}


def tree_step(model, group: SharedPrefixGroup, objective: RLObjective, wave_size: int,
              packed=None):
    packed = packed if packed is not None else tree_inputs(group)
    P, R = group.prompt_length, model.config.looped_num_loops
    out = model(packed["tokens"], position_ids=packed["positions"],
                attention_mask=packed["mask"])
    logits = torch.stack(out.logits)[:, 0]  # [R, L, V]
    G, S1 = packed["index"].shape
    picked = logits[:, packed["index"].reshape(-1)]  # [R, G * (S + 1), V]
    labels = group.labels[:, P - 1 :].reshape(1, -1).expand(R, -1)  # [R, G * (S + 1)]
    logprobs = token_logprobs(picked, labels).reshape(R, G, S1)  # [R, G, S + 1]
    weights = objective.token_weights(group.loss_mask)[:, P - 1 :]
    loss, _ = objective.loss(logprobs, group.old_logprobs[:, :, P - 1 :], group.advantages,
                             weights)
    loss.backward()
    return loss.detach()


# ---- shared-prefix joint replay ------------------------------------------------------------

@contextlib.contextmanager
def prefix_attention(model, mode: str):
    """Temporarily switch ``looped_prefix_attention`` of the (shared) model config."""
    old = model.config.looped_prefix_attention
    model.config.looped_prefix_attention = mode
    try:
        yield
    finally:
        model.config.looped_prefix_attention = old


def joint_step(model, group: SharedPrefixGroup, objective: RLObjective, wave_size,
               checkpoint_waves: bool = False, attention: str = "cascade",
               prompt: str = "recompute", chooser=None, memory_budget=None):
    plan = {} if chooser is not None else {"prompt": prompt}  # a chooser carries its own
    schedule = get_shared_prefix_forward_backward_func(
        wave_size, checkpoint_waves=checkpoint_waves, chooser=chooser,
        memory_budget=memory_budget, **plan)
    with prefix_attention(model, attention):
        out = schedule(forward_step_func=rl_forward_step(objective),
                       data_iterator=iter([group]), model=model, num_microbatches=1,
                       seq_length=0, micro_batch_size=1)
    return out[0]["loss"].detach()


def auto_planner(model, group: SharedPrefixGroup, wave_size: int) -> Planner:
    """``auto``'s chooser: joint replay at ``wave_size`` (retain) or naive with all G in one
    microbatch (the ``naive`` row), by a cost model calibrated on ``model`` now."""
    return Planner(wave_size, "auto", schedule="auto", cost_model=CostModel.calibrate(model),
                   naive_micro_batch_size=group.group_size)


def step_functions(model, group: SharedPrefixGroup, objective: RLObjective,
                   wave_size: int, planner=None, variants: bool = True) -> dict:
    """name -> zero-argument callable running one full training step (grads zeroed first);
    without ``variants`` the ``VARIANTS`` are left out."""
    packed = tree_inputs(group)
    if variants:
        planner = planner or auto_planner(model, group, wave_size)
    raw = {
        "naive": lambda: step_loss(naive_step([model], [group], rl_forward_step(objective),
                                              micro_batch_size=group.group_size)),
        "naive_mb1": lambda: step_loss(naive_step([model], [group], rl_forward_step(objective),
                                                  micro_batch_size=1)),
        "tree": partial(tree_step, model, group, objective, wave_size, packed=packed),
        "joint": partial(joint_step, model, group, objective, wave_size),
        "joint_retain": partial(joint_step, model, group, objective, wave_size, prompt="retain"),
        "auto": partial(joint_step, model, group, objective, wave_size, chooser=planner),
        "joint_ckpt": partial(joint_step, model, group, objective, wave_size,
                              checkpoint_waves=True),
        "joint_concat": partial(joint_step, model, group, objective, wave_size,
                                attention="concat"),
    }

    def zeroed(fn):
        def step():
            model.zero_grad(set_to_none=True)
            return fn()
        return step

    return {name: zeroed(raw[name]) for name in SCHEDULES if variants or name not in VARIANTS}
