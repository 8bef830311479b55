"""Does a run fit? ``python -m scalerlt_mcore.plan`` with the run's flags (``--config``,
``--pretrained-checkpoint --use-checkpoint-args``, ``--bf16``, ...) and the workload's
(``--world-size``, ``--plan-prompt-length``; S and G are the run's ``--rl-max-response-length``
and ``--grpo-group-size``; with ``--rl-rollout tree`` a group is the largest tree of
``--rl-tree-branches``: every answer S tokens, every reply between turns ``--plan-reply-length``).

The run's model is built at full size on ``meta`` (no memory, no FLOPs), at the run's
``--tensor-model-parallel-size`` as its rank 0 holds it (one process: ``model_parallel_context``
on PyTorch's fake backend beyond TP 1), and the planner's memory model is calibrated there
(``ModelShape.from_model``). Printed per GPU: the model state
(parameters, fp32 gradient buffers, Adam shards, the KL reference), the rollout cache, and for
naive micro-batch 1, naive with activation recompute, joint replay and joint replay with
recompute: the peak of activations + prefix adjoints, the step's FLOPs and the plan chosen under
the budget left beside the model state; then the plan the run itself would choose. Nothing
that fits, or a run whose own plan does not fit: one line naming the shortfall and the smallest
change found that fits (``smallest_change``: fewer samples at once, recompute, a wider TP degree,
fewer loops, a shorter prompt), exit status 1. Pipeline parallelism is refused.
"""

import argparse
import copy
import dataclasses
import logging
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from ..model.decode_graph import DecodeGraphs
from ..shared_prefix.group import SharedPrefixGroup
from ..shared_prefix.planner import (
    CostModel,
    GroupPlan,
    MemoryEstimate,
    ModelShape,
    Planner,
    pass_flops,
    plan_memory,
)
from ..shared_prefix.tree import TreeSegment
from ..shared_prefix.tree_schedule import nodes_with_loss
from ..testing import model_parallel_context
from .config import (
    ConfigError,
    model_config,
    objective_from,
    parse_args,
    prompts_per_step,
    schedule_from,
    task_from,
    tokenizer_from,
    validate,
)
from .config.rl import max_reply_tokens, parse_tree_branches, rollout_positions, tree_turns
from .pretrained import resolve_pretrained, run_vocab_size
from .runtime import build_model

GIB = 2**30
META = torch.device("meta")
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1}
"""MCore's activation recompute of the "with recompute" rows: every layer application."""

USAGE = "python -m scalerlt_mcore.plan [--config FILE.yaml] [--TRAIN-FLAG VALUE ...] [plan flags]"


@dataclass(frozen=True)
class Workload:
    """What the plan is made for, beside the run's config."""

    world_size: int
    prompt_length: int
    gpu_bytes: float
    reply_length: int = 0
    """A multi-turn tree's environment reply between two answers, in tokens."""


@dataclass(frozen=True)
class Row:
    """One way to train the workload's groups."""

    name: str
    plan: Optional[GroupPlan]
    """The plan chosen under the budget (None: none fits; ``memory`` is then the smallest's)."""
    memory: MemoryEstimate
    flops: float
    """Per GPU per RL step: every group of the rank, every ``grpo_iterations`` pass."""


@dataclass
class Report:
    """The plan command's result (``format_report`` prints it)."""

    cfg: object
    workload: Workload
    parameters: int
    state: dict
    """Per-GPU bytes of the model state: parameters, gradient buffers, optimizer, KL reference."""
    rollout_cache: int
    rows: list
    run_plan: Optional[GroupPlan] = None
    run_memory: Optional[MemoryEstimate] = None
    run_error: str = ""
    change: Optional[str] = None
    """Where the run does not fit: the smallest change found that fits, '' where none was
    (``smallest_change``); None: not looked for."""

    @property
    def state_bytes(self) -> int:
        return sum(self.state.values())

    @property
    def resident_bytes(self) -> int:
        """What a training step finds held: the model state, and the rollout cache where
        graphed decoding keeps it across steps (``rl_decode_cuda_graph``; else it is freed
        when the rollout returns)."""
        kept = self.rollout_cache if self.cfg.rl.rl_decode_cuda_graph else 0
        return self.state_bytes + kept

    @property
    def budget(self) -> float:
        """What a training step may take beside ``resident_bytes``."""
        return self.workload.gpu_bytes - self.resident_bytes


# ---- the command line -------------------------------------------------------------------------


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scalerlt_mcore.plan", usage=USAGE, description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is the training command's (python -m scalerlt_mcore.train "
               "--help).")
    p.add_argument("--world-size", type=int, default=8,
                   help="GPUs of the job (default 8): data parallel = world size / TP")
    p.add_argument("--plan-prompt-length", type=int, default=512,
                   help="prompt tokens P of a group (default 512)")
    p.add_argument("--plan-gpu-memory-gib", type=float, default=96.0,
                   help="memory of one GPU in GiB (default 96, an H20)")
    p.add_argument("--plan-reply-length", type=int, default=None,
                   help="a multi-turn tree's environment reply in tokens (default: the longest "
                        "the run's task gives with its tokenizer)")
    return p


def parse(argv) -> tuple:
    """(the run's config, resolved and validated at the world size and its TP degree, the
    ``Workload``). Pipeline parallelism is refused: the model is built as one stage."""
    p = plan_parser()
    if "-h" in argv or "--help" in argv:
        p.print_help()
        raise SystemExit(0)
    args, rest = p.parse_known_args(argv)
    for flag, value in (("--world-size", args.world_size),
                        ("--plan-prompt-length", args.plan_prompt_length),
                        ("--plan-gpu-memory-gib", args.plan_gpu_memory_gib)):
        if value <= 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    cfg = parse_args(rest)
    resolve_pretrained(cfg)
    validate(cfg, args.world_size, gpu=True)  # a plan for GPUs, wherever it is made
    if cfg.model.pipeline_model_parallel_size != 1:
        raise ConfigError(f"the plan command builds the model as one pipeline stage: it plans "
                          f"pipeline_model_parallel_size 1, got "
                          f"{cfg.model.pipeline_model_parallel_size}")
    reply = _reply_length(cfg, args.plan_reply_length)
    path = _path_length(cfg, reply)
    T = args.plan_prompt_length + path
    if T > cfg.model.max_position_embeddings:
        what = (f"rl_max_response_length {path}" if path == cfg.rl.rl_max_response_length
                else f"{path} positions of a tree's turns and replies")
        raise ConfigError(f"--plan-prompt-length {args.plan_prompt_length} + {what} = {T} "
                          f"positions: max_position_embeddings is "
                          f"{cfg.model.max_position_embeddings}")
    return cfg, Workload(args.world_size, args.plan_prompt_length,
                         args.plan_gpu_memory_gib * GIB, reply)


def _reply_length(cfg, flag: Optional[int]) -> int:
    """The reply between a tree's turns: the flag's, else the run's task's longest (0 for one
    turn)."""
    if tree_turns(cfg.rl) == 1:
        return 0
    if flag is not None:
        if flag < 0:
            raise ConfigError(f"--plan-reply-length must be >= 0, got {flag}")
        return flag
    try:
        return max_reply_tokens(task_from(cfg), tokenizer_from(cfg))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--plan-reply-length: the run's task and tokenizer do not give the "
                          f"replies' length ({e}); give it") from None


def _path_length(cfg, reply: int) -> int:
    """Positions after the prompt on a root-to-leaf row: every turn's answer and the replies
    between them."""
    turns = tree_turns(cfg.rl)
    return turns * cfg.rl.rl_max_response_length + (turns - 1) * reply


# ---- the model on meta and its state ----------------------------------------------------------


def meta_model(cfg, recompute: Optional[bool] = None):
    """The run's model at full size with every parameter on ``meta`` (inside an MCore
    model-parallel context); ``recompute`` True: with ``RECOMPUTE``'s settings, False: without
    recompute, None: as the run sets it."""
    if recompute is not None:
        fields = RECOMPUTE if recompute else dict.fromkeys(RECOMPUTE)
        cfg = copy.deepcopy(cfg)
        cfg.model = dataclasses.replace(cfg.model, **fields)
    config = model_config(cfg, "cpu")  # host-side initialisation: under meta, no memory
    with torch.device(META):
        model = build_model(cfg, config, run_vocab_size(cfg), "meta")
    rope = getattr(model, "rotary_pos_emb", None)  # MCore keeps inv_freq outside the buffers
    if rope is not None:  # and moves it to the device at its first forward
        rope.inv_freq = rope.inv_freq.to(META)
    return model


def data_parallel_size(cfg, world_size: int) -> int:
    return world_size // cfg.model.tensor_model_parallel_size


HEADROOM = 0.9
"""The share of what a GPU has left beside the model state that the default budget gives a
training step's activations and prefix adjoints (the planner's prediction); the rest is for
what the prediction leaves out: the allocator's fragmentation, workspaces, communication
buffers."""


def device_budget(cfg, model, device: torch.device, world_size: int,
                  longest_row: int) -> Optional[float]:
    """The default ``shared_prefix_memory_budget`` in bytes of a run on a CUDA ``device``, as
    its trainer is built: ``HEADROOM`` x what the device can still allocate (free, or held
    free by PyTorch's allocator), less the state not allocated yet (Adam's moments, taken at
    the first step; the KL reference) and the rollout caches graphed decoding keeps (as many
    as ``DecodeGraphs`` keeps shapes, rows of ``longest_row`` positions at most). None off a
    GPU or where the run sets a budget."""
    if cfg.shared_prefix.shared_prefix_memory_budget is not None or device.type != "cuda":
        return None
    free = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))
    state = state_bytes(cfg, model, world_size)
    pending = state["Adam moments"] + state["KL reference"]
    if cfg.rl.rl_decode_cuda_graph:
        pending += DecodeGraphs().capacity * rollout_cache_bytes(
            cfg, model, Workload(world_size, 0, 0.0), positions=longest_row)
    budget = HEADROOM * (free - pending)
    if budget <= 0:
        raise ValueError(f"shared_prefix_memory_budget: {device} has {_size(free)} free and "
                         f"the model state still takes {_size(pending)}; nothing is left for "
                         f"a training step (python -m scalerlt_mcore.plan says what fits)")
    return budget


def state_bytes(cfg, model, world_size: int) -> dict:
    """Per-GPU bytes of the model state: parameters in the run's dtype, MCore DDP's fp32
    gradient buffers (``grad_reduce_in_fp32``), Adam's fp32 moments and (bf16/fp16) fp32 main
    weights, sharded over data parallelism by the distributed optimizer, and the frozen KL
    reference (a copy of the parameters, with ``grpo_kl_beta`` > 0)."""
    count = sum(p.numel() for p in model.parameters())
    width = next(model.parameters()).dtype.itemsize
    shards = data_parallel_size(cfg, world_size) if cfg.training.use_distributed_optimizer else 1
    kl = cfg.rl.grpo_kl_beta > 0
    return {"parameters": width * count, "gradient buffers": 4 * count,
            "fp32 main weights": round(4 * (width < 4) * count / shards),
            "Adam moments": round(8 * count / shards), "KL reference": width * count * kl}


def rollout_cache_bytes(cfg, model, workload: Workload, positions: Optional[int] = None) -> int:
    """The rank's rollout K/V cache at its longest: every depth, K and V, in the run's dtype,
    of ``rollout_positions`` (the rank's prompts, ``inference_max_requests`` samples at a
    time; an evaluation decodes no more: ``RLTrainer.eval_rows``). ``positions``: each row's
    at most, every row its own (instead of the workload's prompt and the responses)."""
    c, rl = model.config, cfg.rl
    width = next(model.parameters()).dtype.itemsize
    per_token = (c.looped_num_depths * 2 * (c.num_query_groups or c.num_attention_heads)
                 // c.tensor_model_parallel_size * c.kv_channels * width)
    if positions is not None:
        return per_token * _rows_at_once(cfg, workload) * positions
    prompts = prompts_per_step(cfg) // data_parallel_size(cfg, workload.world_size)
    return per_token * rollout_positions(rl, workload.prompt_length, workload.reply_length,
                                         prompts)


def _rows_at_once(cfg, workload: Workload) -> int:
    """The samples a rank's rollout decodes at once: its prompts' G each, at most
    ``inference_max_requests``."""
    rows = (prompts_per_step(cfg) // data_parallel_size(cfg, workload.world_size)
            * cfg.rl.grpo_group_size)
    return min(rows, cfg.rl.inference_max_requests or rows)


# ---- the rows ---------------------------------------------------------------------------------


def _flops(m: ModelShape, group, plan: GroupPlan, checkpoint_waves: bool,
           recompute: bool) -> float:
    """FLOPs of one group's step by ``plan`` (the cost model's count: forward 1, backward 2),
    plus the layers' forward once more under full recompute (the readouts are not
    recomputed); a deeper tree's joint replay by ``tree_flops``."""
    P, S, G = group.prompt_length, group.response_length, group.group_size
    tree = group.tree
    if not plan.naive and tree is not None and tree.depth > 1:
        return tree_flops(m, tree, plan, nodes_with_loss(group), recompute)
    flops = CostModel(call_s=0.0, flop_s=1.0).time(m, P, S, G, plan, checkpoint_waves)
    if recompute:
        flops += (pass_flops(m, G, P + S, 0) if plan.naive
                  else pass_flops(m, 1, P, 0) + pass_flops(m, G, S, P))
    return flops


def tree_flops(m, tree, plan, has_loss: list, recompute: bool = False) -> float:
    """Joint replay of a tree by ``plan``, as the tree schedule runs it (benchmarks/tree.py's
    ``analytic_passes``): an internal node's layers forward 1 + backward 2 (a recomputed one's
    forward once more, without grad), read out at its own positions and its parent's boundary
    where it trains a token; a leaf the same without its last token, read out there; one
    boundary readout per wave; under full recompute every node's layers once more
    (``_flops``'s count)."""
    def read(positions: int) -> float:
        return m.loops * positions * 2 * m.hidden * m.vocab

    retained, W = plan.node_retained(tree.num_nodes), plan.wave_size
    flops = 0.0
    for n in range(tree.num_nodes):
        start, L = tree.starts[n], tree.ends[n] - tree.starts[n]
        if tree.is_leaf(n):
            layers, readouts, passes = pass_flops(m, 1, L - 1, start), L - 1, 3
        else:
            leaves = len(tree.leaf_children(n))
            layers, passes = pass_flops(m, 1, L, start), 3 + (not retained[n])
            readouts = (L + 1 if n and has_loss[n] else 0) + -(-leaves // W)
        flops += passes * layers + 3 * read(readouts) + recompute * layers
    return flops


def _naive_row(name, m, cfg, workload, recompute) -> Row:
    group = workload_group(cfg, workload)
    P, S, G = group.prompt_length, group.response_length, group.group_size
    plan, loss = GroupPlan(1, naive=True), _loss_per_position(cfg)
    return Row(name, plan, plan_memory(m, P, S, G, plan, loss_per_position=loss),
               _flops(m, group, plan, False, recompute) * _groups(cfg, workload))


def _joint_row(name, model, m, cfg, workload, budget, recompute) -> Row:
    """Joint replay by the planner's choice (largest wave, retain before recompute, then the
    fewest prompt segments) under ``budget``, on ``model`` as built (with or without activation
    recompute); the smallest plan's peak when none fits or the planner refuses (checkpointed
    waves under recompute)."""
    group = workload_group(cfg, workload)
    waves = cfg.shared_prefix.shared_prefix_checkpoint_waves
    planner = Planner("auto", "auto", memory_budget=max(budget, 1.0), checkpoint_waves=waves,
                      loss_per_position=_loss_per_position(cfg))
    try:
        plan = planner(group, model, cfg.model.looped_num_loops)
    except ValueError:
        plan, chosen = _smallest_plan(planner, group), None
    else:
        chosen = plan
    return Row(name, chosen, planner.group_memory(m, group, plan),
               _flops(m, group, plan, waves, recompute) * _groups(cfg, workload))


def _smallest_plan(planner: Planner, group) -> GroupPlan:
    """The plan of the least memory: a one-level group's by the planner, a deeper tree's
    waves of 1 with every node recomputed."""
    tree = group.tree
    if tree is None or tree.depth == 1:
        return planner.smallest_plan(group.prompt_length)
    return GroupPlan(1, retain_nodes=(False,) * tree.num_nodes)


def _loss_per_position(cfg) -> float:
    return objective_from(cfg).saved_per_position


def workload_group(cfg, workload: Workload):
    """What a planner reads of a group of the workload's shape: a one-level group's sizes, or
    with ``rl_rollout tree`` the group of the largest tree the run decodes (``tree_segments``,
    token ids 0)."""
    if cfg.rl.rl_rollout != "tree":
        return SimpleNamespace(prompt_length=workload.prompt_length, group_id=0, tree=None,
                               response_length=cfg.rl.rl_max_response_length,
                               group_size=cfg.rl.grpo_group_size)
    segments = tree_segments(workload.prompt_length, parse_tree_branches(cfg.rl.rl_tree_branches),
                             cfg.rl.rl_max_response_length, workload.reply_length)
    return SharedPrefixGroup.from_tree(segments, 0, device="cpu")


def tree_segments(P: int, branches: tuple, answer: int, reply: int) -> list:
    """The ``TreeSegment``s of a tree of ``branches`` (children per depth below the root): a
    prompt of P tokens, every answer ``answer`` tokens (trained), each followed by a reply of
    ``reply`` (not trained) but on the last turn; nodes depth first, as tree rollouts give
    them."""
    segments = [TreeSegment(torch.zeros(P, dtype=torch.long, device="cpu"), None)]

    def grow(parent: int, depth: int) -> None:
        if depth == len(branches):
            return
        tail = 0 if depth == len(branches) - 1 else reply
        mask = torch.cat([torch.ones(answer, device="cpu"), torch.zeros(tail, device="cpu")])
        for _ in range(branches[depth]):
            segments.append(TreeSegment(torch.zeros(answer + tail, dtype=torch.long,
                                                    device="cpu"), parent, mask))
            grow(len(segments) - 1, depth + 1)

    grow(0, 0)
    return segments


def _groups(cfg, workload: Workload) -> int:
    """Groups one GPU trains per RL step (every PPO pass)."""
    per_rank = prompts_per_step(cfg) // data_parallel_size(cfg, workload.world_size)
    return per_rank * cfg.rl.grpo_iterations


def run_choice(cfg, model, m: ModelShape, workload: Workload, budget: float) -> tuple:
    """(the plan the run's own schedule picks for a group of the workload, its memory, an error
    line): its planner with the run's budget (unset: ``HEADROOM`` x ``budget``, what the GPU
    has left beside the model state, as ``device_budget`` gives a run on it);
    ``shared_prefix_schedule auto`` is planned as joint replay (the run picks naive or joint
    by time measured on its GPU)."""
    if cfg.shared_prefix.shared_prefix_schedule == "auto":
        cfg = copy.deepcopy(cfg)
        cfg.shared_prefix.shared_prefix_schedule = "joint_replay"
    try:
        chooser = schedule_from(cfg, default_budget=HEADROOM * budget).chooser
    except ValueError as e:  # no budget left: the shortfall says what does not fit
        return None, None, str(e)
    group = workload_group(cfg, workload)
    try:
        plan = chooser(group, model, cfg.model.looped_num_loops)
    except ValueError as e:
        return None, None, str(e)
    return plan, chooser.group_memory(m, group, plan), ""


def make_report(cfg, workload: Workload, model=None, twin=None) -> Report:
    """Plan ``workload`` for the run: its model on meta (``model``, or built here) and twins
    with and without recompute (``twin``: the one with recompute, or built here), each
    calibrated. Inside an MCore model-parallel context at ``cfg``'s TP degree (``tp_context``).
    A caller planning several workloads on one model passes both, so that each is built and
    calibrated once."""
    logging.getLogger("megatron.core.transformer.transformer_layer").setLevel(logging.ERROR)
    model = meta_model(cfg) if model is None else model
    own = cfg.model.recompute_granularity is not None
    plain = meta_model(cfg, recompute=False) if own else model
    twin = meta_model(cfg, recompute=True) if twin is None else twin
    R = cfg.model.looped_num_loops
    m, mr = ModelShape.from_model(plain, R), ModelShape.from_model(twin, R)
    report = Report(cfg, workload, sum(p.numel() for p in model.parameters()),
                    state_bytes(cfg, model, workload.world_size),
                    rollout_cache_bytes(cfg, model, workload), [], None, None)
    budget = report.budget
    report.run_plan, report.run_memory, report.run_error = run_choice(
        cfg, model, ModelShape.from_model(model, R), workload, budget)
    report.rows = [
        _naive_row("naive, micro-batch 1", m, cfg, workload, False),
        _naive_row("naive, micro-batch 1, recompute", mr, cfg, workload, True),
        _joint_row("joint replay", plain, m, cfg, workload, budget, False),
        _joint_row("joint replay, recompute", twin, mr, cfg, workload, budget, True)]
    return report


def tp_context(cfg):
    """A model-parallel context of its own at ``cfg``'s TP degree, in this one process
    (``model_parallel_context``: rank 0's shards on meta beyond TP 1); what is built inside it
    is used only there."""
    return model_parallel_context(seed=cfg.training.seed,
                                  tensor_model_parallel_size=cfg.model.tensor_model_parallel_size)


def plan_run(cfg, workload: Workload) -> Report:
    """``make_report`` at the run's TP degree (``tp_context``); where the run does not fit,
    with the smallest change that does (``smallest_change``, after that context)."""
    with tp_context(cfg):
        report = make_report(cfg, workload)
    if shortfall(report):
        report.change = smallest_change(cfg, workload)
    return report


RECOMPUTE_FLAGS = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
"""``RECOMPUTE`` as the training command's flags."""


def with_recompute(cfg):
    """A copy of ``cfg`` with ``RECOMPUTE``'s activation recompute."""
    cfg = copy.deepcopy(cfg)
    cfg.model = dataclasses.replace(cfg.model, **RECOMPUTE)
    return cfg


def smallest_change(cfg, workload: Workload) -> str:
    """The smallest change of the run found to fit, in flags, evaluated on meta models, in
    order: fewer samples decoded at once and MCore's full recompute (``_rows_or_recompute``),
    a wider TP degree (``wider_tp``), the most loops that fit (``most_loops``), else the
    longest prompt that fits (``shorter_prompt``); '' when none fits. Called outside any
    process group: each TP degree's models are built and calibrated in that degree's own
    ``tp_context``, and nothing built in one is used in another."""
    with tp_context(cfg):
        change = _rows_or_recompute(cfg, workload, meta_model(cfg),
                                    meta_model(cfg, recompute=True))
    change = change or wider_tp(cfg, workload)
    if change:
        return change
    with tp_context(cfg):
        return most_loops(cfg, workload) or shorter_prompt(cfg, workload)


def shorter_prompt(cfg, workload: Workload) -> str:
    """'[--inference-max-requests N] --plan-prompt-length P (...)': the longest prompt that
    fits (``longest_prompt``), with the samples decoded at once that fit; '' where none does.
    Inside ``tp_context(cfg)``."""
    model, twin = meta_model(cfg), meta_model(cfg, recompute=True)
    rows = rows_that_fit(cfg, workload, model)
    flags = "" if rows is None else f"--inference-max-requests {rows}"
    P = longest_prompt(_with_rows(cfg, rows), workload, model, twin)
    return "" if P is None else (f"{flags} --plan-prompt-length {P} (the longest prompt that "
                                 f"fits)").strip()


REFUSED = (ConfigError, NotImplementedError, ValueError)
"""What a config the run's model or checks refuse raises (``validate``, the model build)."""


def wider_tp(cfg, workload: Workload) -> str:
    """'add --tensor-model-parallel-size t ...': the least TP degree above the run's
    (``wider_degrees``) at which the run fits as it is or with ``_rows_or_recompute``'s change,
    each degree's models built and calibrated in its own ``tp_context``; a degree whose config
    or model is refused (a family or feature without tensor parallelism) is skipped."""
    for t in wider_degrees(cfg.model.tensor_model_parallel_size, workload.world_size):
        wide = at_degree(cfg, t, workload.world_size)
        change = "" if wide is None else _change_at_degree(wide, workload)
        if change:
            return change
    return ""


def wider_degrees(tp: int, world_size: int) -> list:
    """The TP degrees 2, 4, 8, ... above ``tp`` that divide ``world_size``."""
    degrees, t = [], 2
    while t <= world_size:
        if t > tp and world_size % t == 0:
            degrees.append(t)
        t *= 2
    return degrees


def at_degree(cfg, t: int, world_size: int):
    """A copy of ``cfg`` at TP ``t``, checked as ``parse`` checks the run's (``validate``);
    None where refused."""
    wide = copy.deepcopy(cfg)
    wide.model = dataclasses.replace(wide.model, tensor_model_parallel_size=t)
    try:
        validate(wide, world_size, gpu=True)
    except REFUSED:
        return None
    return wide


def _change_at_degree(cfg, workload: Workload) -> str:
    """``cfg``'s TP flag where the run fits at it, with ``_rows_or_recompute``'s flags where it
    needs them; '' where it does not fit or its model refuses the degree."""
    flag = f"--tensor-model-parallel-size {cfg.model.tensor_model_parallel_size}"
    with tp_context(cfg):
        try:
            model, twin = meta_model(cfg), meta_model(cfg, recompute=True)
        except REFUSED:
            return ""
        return (_fitting(make_report(cfg, workload, model, twin), flag)
                or _rows_or_recompute(cfg, workload, model, twin, given=flag))


def _with_rows(cfg, rows: Optional[int]):
    """``cfg``, or a copy decoding ``rows`` samples at a time."""
    if rows is None:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.rl.inference_max_requests = rows
    return cfg


def _rows_or_recompute(cfg, workload: Workload, model, twin, given: str = "") -> str:
    """'add FLAGS (plan, per GPU)' where the run fits with the most samples decoded at once
    that fit (``rows_that_fit``, where the rollout cache is over) and, where the run has none
    and it needs it, MCore's full recompute; else ''. ``given``: flags ``cfg`` already
    carries, named first."""
    rows = rows_that_fit(cfg, workload, model)
    flags, cfg = (given if rows is None else f"{given} --inference-max-requests {rows}".strip(),
                  _with_rows(cfg, rows))
    if rows is not None and (fits := _fitting(make_report(cfg, workload, model, twin), flags)):
        return fits
    if cfg.model.recompute_granularity is not None:
        return ""
    report = make_report(with_recompute(cfg), workload, twin, twin)
    return _fitting(report, f"{flags} {RECOMPUTE_FLAGS}".strip())


def most_loops(cfg, workload: Workload) -> str:
    """'add --looped-num-loops N ...': the most loops below the run's at which it fits as it
    is, or with ``_rows_or_recompute``'s change (a bisection; each count's models built and
    calibrated on meta); '' where one loop does not fit."""
    def change(R: int) -> str:
        c = copy.deepcopy(cfg)
        c.model.looped_num_loops = R
        model, twin = meta_model(c), meta_model(c, recompute=True)
        flag = f"--looped-num-loops {R}"
        return (_fitting(make_report(c, workload, model, twin), flag)
                or _rows_or_recompute(c, workload, model, twin, given=flag))

    low, high, best = 1, cfg.model.looped_num_loops - 1, ""
    while low <= high:  # the largest R whose change is found
        mid = (low + high) // 2
        found = change(mid)
        low, high, best = (mid + 1, high, found) if found else (low, mid - 1, best)
    return best


def _fitting(report: Report, flags: str) -> str:
    """'add FLAGS (the plan, its per-GPU total)' where ``report`` fits, else ''."""
    if shortfall(report):
        return ""
    return (f"add {flags} ({plan_text(report.run_plan)}, "
            f"{_size(report.resident_bytes + report.run_memory.peak_bytes)} per GPU)")


def rows_that_fit(cfg, workload: Workload, model) -> Optional[int]:
    """The most samples decoded at once (``--inference-max-requests``) at which the model state
    and rollout cache fit, where they do not as the run decodes; None where they do, or where
    no count fits (a tree decodes whole trees: at least G)."""
    state = sum(state_bytes(cfg, model, workload.world_size).values())
    if state + rollout_cache_bytes(cfg, model, workload) <= workload.gpu_bytes:
        return None
    rl, fewer = cfg.rl, copy.deepcopy(cfg)
    least = rl.grpo_group_size if rl.rl_rollout == "tree" else 1
    for rows in range(_rows_at_once(cfg, workload) - 1, least - 1, -1):
        fewer.rl.inference_max_requests = rows
        if state + rollout_cache_bytes(fewer, model, workload) <= workload.gpu_bytes:
            return rows
    return None


def longest_prompt(cfg, workload: Workload, model, twin) -> Optional[int]:
    """The longest prompt below the workload's at which the model state and rollout cache fit,
    a row's plan fits beside them and the run's schedule finds a plan (memory grows with the
    prompt; the run may still need the ``--shared-prefix-memory-budget`` its shortfall names
    there), or None where one token does not fit."""
    def fits(P: int) -> bool:
        return plannable(make_report(cfg, dataclasses.replace(workload, prompt_length=P),
                                     model, twin))

    high = workload.prompt_length  # does not fit
    low = high // 2
    while low >= 1 and not fits(low):
        high, low = low, low // 2
    if low < 1:
        return None
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


# ---- printing ---------------------------------------------------------------------------------


def _unit(r: Report) -> tuple:
    """(name, bytes) of the table's unit: GiB, or MiB for a model whose step takes less."""
    biggest = max([r.state_bytes, r.rollout_cache] + [row.memory.peak_bytes for row in r.rows])
    return ("GiB", GIB) if biggest >= GIB else ("MiB", 2**20)


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def plan_text(plan: Optional[GroupPlan], tree=None) -> str:
    """A plan in words; a tree's: how many of its internal nodes it retains."""
    if plan is None:
        return "none fits"
    if plan.naive:
        return f"naive, micro-batch {plan.wave_size}"
    if plan.state_kind == "inputs":
        return _joint_text(plan, tree) + ", prefix state of layer inputs"
    return _joint_text(plan, tree)


def _joint_text(plan: GroupPlan, tree=None) -> str:
    if plan.retain_nodes is not None and tree is not None:
        internal = tree.inner_nodes
        kept = sum(plan.retain_nodes[n] for n in internal)
        split = (f", the prompt in {plan.prompt_segments} segments"
                 if plan.prompt_segments > 1 else "")
        return f"waves of {plan.wave_size}, {kept}/{len(internal)} internal nodes retained{split}"
    if plan.prompt_segments > 1:
        return f"waves of {plan.wave_size}, prompt recomputed in {plan.prompt_segments} segments"
    return f"waves of {plan.wave_size}, prompt {'retained' if plan.retain else 'recomputed'}"


def format_report(r: Report) -> str:
    """The per-GPU table (GiB), the rows and the run's own plan."""
    cfg, w = r.cfg, r.workload
    dp = data_parallel_size(cfg, w.world_size)
    unit, size = _unit(r)
    tp = cfg.model.tensor_model_parallel_size
    lines = [f"model: {_count(r.parameters)} parameters{' per GPU' if tp > 1 else ''}, "
             f"{cfg.model.looped_num_loops} loops, "
             f"{'bf16' if cfg.model.bf16 else 'fp16' if cfg.model.fp16 else 'fp32'}; "
             f"{w.world_size} GPUs of {w.gpu_bytes / GIB:g} GiB, TP {tp}, DP {dp}; "
             f"{_group_text(cfg, w)}; "
             f"{_groups(cfg, w)} group(s) per GPU per step", "",
             f"per GPU {unit:>41}"]
    lines += [f"  {name:<38}{v / size:10.2f}" for name, v in r.state.items()]
    lines += [f"  {'model state':<38}{r.state_bytes / size:10.2f}",
              f"  {'rollout cache (during rollouts)':<38}{r.rollout_cache / size:10.2f}", "",
              f"training step, under {r.budget / size:.2f} {unit} (the GPU less the model "
              f"state{' and the kept cache' if r.resident_bytes > r.state_bytes else ''}), "
              f"{unit}:",
              f"  {'schedule':<34}{'activations':>12}{'adjoints':>10}{'peak':>9}"
              f"{'FLOP':>10}  plan"]
    tree = workload_group(cfg, w).tree
    for row in r.rows:
        e = row.memory
        lines.append(f"  {row.name:<34}{e.activation_bytes / size:12.2f}"
                     f"{e.adjoint_bytes / size:10.2f}{e.peak_bytes / size:9.2f}"
                     f"{row.flops:10.3g}  {plan_text(row.plan, tree)}")
    lines.append("")
    if r.run_plan is None:
        lines.append(f"the run's schedule: {r.run_error}")
    else:
        sp, total = cfg.shared_prefix, r.resident_bytes + r.run_memory.peak_bytes
        budget = sp.shared_prefix_memory_budget
        lines.append(f"the run's schedule ({sp.shared_prefix_schedule}, wave size "
                     f"{sp.shared_prefix_wave_size}, "
                     f"{_budget_text(budget, r.budget)}): "
                     f"{plan_text(r.run_plan, tree)}, peak {r.run_memory.peak_bytes / size:.2f} "
                     f"{unit}; {total / size:.2f} {unit} per GPU in training")
    return "\n".join(lines)


def _group_text(cfg, w: Workload) -> str:
    """The workload's group in words: P, S, G, or a tree's branches and lengths."""
    P, S, G = w.prompt_length, cfg.rl.rl_max_response_length, cfg.rl.grpo_group_size
    if cfg.rl.rl_rollout != "tree":
        return f"a group: P {P}, S {S}, G {G}"
    replies = f", replies of {w.reply_length}" if tree_turns(cfg.rl) > 1 else ""
    return (f"a tree: P {P}, branches {cfg.rl.rl_tree_branches}, answers of {S}{replies}, "
            f"G {G} leaves")


def _budget_text(mib: Optional[float], left: float) -> str:
    """The run's budget: its flag's, or the default on its GPU (``HEADROOM`` x ``left``)."""
    if mib is not None:
        return f"budget {mib:g} MiB"
    return f"default budget {HEADROOM * left / 2**20:.0f} MiB: {HEADROOM:.0%} of the rest"


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.2f} MiB"


def plannable(r: Report) -> bool:
    """The model state and rollout cache fit, a row's plan fits beside the state, and the run's
    schedule finds a plan: what ``shortfall`` checks but the run's plan's own peak."""
    gpu, held = r.workload.gpu_bytes, r.resident_bytes
    return (r.state_bytes + r.rollout_cache <= gpu and r.run_plan is not None
            and any(row.plan is not None and held + row.memory.peak_bytes <= gpu
                    for row in r.rows))


def shortfall(r: Report) -> str:
    """'' when the run fits; else one line naming what does not fit and by how much, and the
    smallest change found that fits (``Report.change``, where ``plan_run`` looked for one)."""
    gpu, state, held = r.workload.gpu_bytes, r.state_bytes, r.resident_bytes
    have = f"the GPU has {_size(gpu)}"
    if state + r.rollout_cache > gpu:
        short = (f"the model state and rollout cache need {_size(state + r.rollout_cache)} per "
                 f"GPU, {have}: lower --inference-max-requests (the samples decoded at "
                 f"once), --plan-prompt-length, --grpo-group-size or the prompts per GPU "
                 f"(--global-batch-size), or raise --world-size")
    elif not any(row.plan is not None and held + row.memory.peak_bytes <= gpu
                 for row in r.rows):
        least = min(r.rows, key=lambda row: row.memory.peak_bytes)
        short = (f"needs {_size(held + least.memory.peak_bytes)} per GPU at the least "
                 f"({least.name}), {have}: lower --plan-prompt-length or "
                 f"--rl-max-response-length, or raise --world-size")
    elif r.run_plan is None:
        short = f"the run's schedule finds no plan: {r.run_error}"
    elif held + r.run_memory.peak_bytes > gpu:
        return (f"the run's plan ({plan_text(r.run_plan)}) needs "
                f"{_size(held + r.run_memory.peak_bytes)} per GPU, {have}: set "
                f"--shared-prefix-memory-budget {_mib(r.budget)} (MiB) or lower")
    else:
        return ""
    return short + _change_text(r.change)


def _mib(n: float) -> str:
    """Bytes as the MiB a flag takes: whole MiB, three significant digits below 10 MiB (a
    tiny model's budget is not 0)."""
    mib = n / 2**20
    return f"{mib:.0f}" if mib >= 10 else f"{mib:.3g}"


def _change_text(change: Optional[str]) -> str:
    """The shortfall line's end: the smallest change that fits, or that none was found."""
    if change is None:
        return ""
    if change:
        return f"; the smallest change that fits: {change}"
    return ("; neither fewer samples decoded at once, activation recompute, a wider "
            "tensor-parallel degree, fewer loops nor a shorter prompt fits")


def main(argv=None) -> int:
    """Print the report; a shortfall: one line on stderr, status 1."""
    from .train import USER_ERRORS, exit_with_error, quiet_library_warnings

    quiet_library_warnings()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, workload = parse(argv)
    except USER_ERRORS as e:
        exit_with_error(e)
    report = plan_run(cfg, workload)
    print(format_report(report), flush=True)
    short = shortfall(report)
    if short:
        print(f"error: {short}", file=sys.stderr, flush=True)
        return 1
    return 0
