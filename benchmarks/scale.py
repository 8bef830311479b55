"""Memory and FLOPs at the users' shapes (``make bench``'s ``scale``: benchmarks/results/scale.*).

Full size, predicted: Ouro-1.4B, Huginn-0125 and Nanbeige4.2-3B (each built from its real
config.json on ``meta``, bf16, as ``python -m scalerlt_mcore.plan`` builds it) on an 8-GPU H20
node (DP 8), for workloads M1 (P 512, S 4096, G 16), M2 (P 8192, S 1024, G 8), M3 (P 16384,
S 2048, G 8) and T (a depth-2 tree: P 8192, 4 branches of 1024 answer + 256 reply tokens, 4
leaves of 1024 under each). Per schedule (naive micro-batch 1, with and without MCore's full
recompute; joint replay at the plan the planner picks under the budget, with and without
MCore's full recompute): the peak, the per-GPU total, the step FLOPs, and naive / joint FLOPs at
the plans each picks under the same budget. Every workload goes through the plan command's
``make_report`` (the tree as ``--rl-rollout tree``: its branches, answers and replies).

Scaled down, measured: each workload at 1/``SCALE`` of its lengths (the same G and branching,
the same P:S proportions) on each family's tiny CPU config (bf16), trained for real by the
run's schedule with naive micro-batch 1 and with the full-size joint plan's shape; the peak
saved bytes of ``SavedTensorProbe`` beside the planner's prediction.

``python -m benchmarks.scale [--out DIR]`` writes DIR/scale.{json,md} (default
benchmarks/results) and prints the tables; ``make bench`` runs it after ``benchmarks.run``.
Method and the committed table: docs/benchmarks.md, "Memory at the users' shapes".
"""

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

# Megatron-Core and the project are imported inside the functions below (as in workloads.py).

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
GPU_GIB = 90.0
"""The per-GPU total a plan must stay under: #41's target for a 96 GB H20 (about 95.6 GiB),
leaving room for the CUDA context, NCCL buffers and fragmentation (docs/gpu.md)."""
WORLD_SIZE = 8
SCALE = 128
"""Scaled-down runs: every length divided by this."""
RTOL = 0.10
"""Predicted peak saved bytes within this of the measured (#41's target)."""
FLOPS_TARGET = 3.0
"""naive / joint FLOPs at plans chosen for the same budget, on M2, M3 and T (#41's target)."""


# ---- the checkpoints' shapes ------------------------------------------------------------------

_OURO_LAYERS = ["full_attention"] * 24
OURO_1_4B = {
    "architectures": ["OuroForCausalLM"], "model_type": "ouro",
    "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                 "AutoModel": "modeling_ouro.OuroModel",
                 "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
    "vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 65536,
    "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
    "tie_word_embeddings": False, "rope_theta": 1000000.0, "rope_scaling": None,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 24,
    "layer_types": _OURO_LAYERS, "attention_dropout": 0.0, "total_ut_steps": 4,
    "early_exit_threshold": 1.0, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16", "transformers_version": "4.55.0"}
"""Ouro-1.4B's config.json (tests/app/test_h20_configs.py holds the same)."""

HUGINN_0125 = {
    "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
    "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                 "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
    "n_embd": 5280, "n_heads": 55, "n_layers": 8, "block_size": 4096, "vocab_size": 65536,
    "padding_multiple": 64, "tie_embeddings": True, "intermediate_size": 17920, "bias": False,
    "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-06, "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU", "init_strategy": "takase", "init_orthogonal": False,
    "state_init": "like-init", "injection_type": "linear", "n_layers_in_recurrent_block": 4,
    "mean_recurrence": 32, "sampling_scheme": "poisson-lognormal-filling",
    "mean_backprop_depth": 8, "n_layers_in_prelude": 2, "n_layers_in_coda": 2,
    "qk_bias": True, "activation_checkpoint_impl": "per-iteration", "rope_base": 50000.0,
    "torch_dtype": "bfloat16", "transformers_version": "4.47.1"}
"""Huginn-0125's config.json (R = 32, backprop through the last 8 loops)."""

NANBEIGE_42_3B = {
    "architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige",
    "auto_map": {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                 "AutoModel": "modeling_nanbeige.NanbeigeModel",
                 "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
    "vocab_size": 166144, "hidden_size": 3072, "intermediate_size": 10752,
    "num_hidden_layers": 22, "num_attention_heads": 48, "num_key_value_heads": 8,
    "head_dim": 128, "kv_channels": 128, "hidden_act": "silu",
    "max_position_embeddings": 262144, "rope_theta": 70000000, "rope_scaling": None,
    "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": 1e-05, "num_loops": 2,
    "loop_loss_weights": [], "skip_loop_final_norm": False, "pretraining_tp": 1,
    "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 166100,
    "eos_token_id": 166101, "torch_dtype": "bfloat16"}
"""Nanbeige4.2-3B's config.json."""


@dataclass(frozen=True)
class Family:
    """A public checkpoint: its 8 x H20 config, its config.json and the tiny CPU config of its
    family (the scaled-down runs)."""

    name: str
    config: str
    shape: dict
    tiny: str


FAMILIES = (Family("Ouro-1.4B", "ouro_1.4b_h20.yaml", OURO_1_4B, "ouro_tiny_cpu.yaml"),
            Family("Huginn-0125", "huginn_0125_h20.yaml", HUGINN_0125, "huginn_tiny_cpu.yaml"),
            Family("Nanbeige4.2-3B", "nanbeige_4.2_3b_h20.yaml", NANBEIGE_42_3B,
                   "nanbeige_tiny_cpu.yaml"))


# ---- the workloads ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleWorkload:
    """A one-level group (P, S, G) or, with ``branches``, a prefix tree: a prompt of P, then per
    depth ``branches[d]`` children of ``node_lengths[d]`` tokens, the first
    ``trained_lengths[d]`` trained (the rest: the environment's reply)."""

    name: str
    prompt_length: int
    response_length: int = 0
    group_size: int = 0
    branches: tuple = ()
    node_lengths: tuple = ()
    trained_lengths: tuple = ()

    @property
    def is_tree(self) -> bool:
        return bool(self.branches)

    def tree_workload(self, **model):
        """The same tree as ``benchmarks.tree.TreeWorkload`` (its node layout and segments)."""
        from .tree import TreeWorkload

        return TreeWorkload(name=self.name, prompt_length=self.prompt_length,
                            branches=self.branches, node_lengths=self.node_lengths,
                            trained_lengths=self.trained_lengths, **model)

    @property
    def G(self) -> int:
        """Rows: the group size, or the tree's leaves."""
        if not self.is_tree:
            return self.group_size
        rows = 1
        for b in self.branches:
            rows *= b
        return rows

    @property
    def S(self) -> int:
        """Positions after the prompt of a row."""
        return sum(self.node_lengths) if self.is_tree else self.response_length

    def scaled(self, factor: int) -> "ScaleWorkload":
        """Every length divided by ``factor`` (at least 1 token; a trained part at least 1 and
        at most its node); the same G and branching."""
        def cut(n: int) -> int:
            return max(1, n // factor)

        nodes = tuple(cut(n) for n in self.node_lengths)
        trained = tuple(min(cut(t), n) for t, n in zip(self.trained_lengths, nodes))
        return ScaleWorkload(self.name, cut(self.prompt_length),
                             cut(self.response_length) if self.response_length else 0,
                             self.group_size, self.branches, nodes, trained)

    @property
    def answer_length(self) -> int:
        """Tokens of every answer: the whole response, or a tree node's trained part."""
        return self.trained_lengths[0] if self.is_tree else self.response_length

    @property
    def reply_length(self) -> int:
        """A tree's environment reply after each answer but the last turn's."""
        return self.node_lengths[0] - self.trained_lengths[0] if self.is_tree else 0

    def describe(self) -> dict:
        return {**asdict(self), "G": self.G, "S": self.S}


WORKLOADS = (ScaleWorkload("M1", 512, 4096, 16), ScaleWorkload("M2", 8192, 1024, 8),
             ScaleWorkload("M3", 16384, 2048, 8),
             ScaleWorkload("T", 8192, branches=(4, 4), node_lengths=(1280, 1024),
                           trained_lengths=(1024, 1024)))
"""#41's workloads; T: P 8192, 4 x (1024 answer + 256 reply), 4 leaves of 1024 under each."""


# ---- full size on meta ------------------------------------------------------------------------


def _source(directory: Path, shape: dict) -> Path:
    """A checkpoint directory without weights: the config.json only."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape))
    return directory


def family_argv(family: Family, source: Path) -> list:
    """The run's flags: its 8 x H20 config with the checkpoint's shape."""
    return ["--config", str(REPO / "configs" / family.config), "--pretrained-checkpoint",
            str(source), "--use-checkpoint-args", "--tokenizer-type", "ByteLevelTokenizer"]


def plan_argv(family: Family, source: Path, wl: ScaleWorkload) -> list:
    """The plan command's flags for ``wl`` (one group per GPU per step: global batch DP x G;
    a tree: a multi-turn task's tree of its branches, answers and replies)."""
    tree = (["--rl-rollout", "tree", "--rl-tree-branches", ",".join(map(str, wl.branches)),
             "--rl-task", "multiturn", "--plan-reply-length", str(wl.reply_length)]
            if wl.is_tree else [])
    return family_argv(family, source) + tree + [
        "--max-position-embeddings", str(wl.prompt_length + wl.S),  # the source's if more
        "--world-size", str(WORLD_SIZE), "--plan-prompt-length", str(wl.prompt_length),
        "--plan-gpu-memory-gib", repr(GPU_GIB), "--rl-max-response-length",
        str(wl.answer_length), "--grpo-group-size", str(wl.G), "--micro-batch-size",
        str(wl.G), "--global-batch-size", str(WORLD_SIZE * wl.G)]


def _family_cfg(family: Family, source: Path):
    """The run's config as the plan command resolves it, validated with the config's own
    workload; the bench's workloads are set on copies (``_for_workload``) without the
    command's position check (the memory model does not depend on the position table; the
    command's refusal is reported beside the figures)."""
    from scalerlt_mcore.app.config import parse_args, validate
    from scalerlt_mcore.app.pretrained import resolve_pretrained

    cfg = parse_args(family_argv(family, source))
    resolve_pretrained(cfg)
    validate(cfg, WORLD_SIZE)
    return cfg


def plan_command_says(argv: list) -> str:
    """The plan command's own refusal of ``argv`` before planning ('' when it plans)."""
    from scalerlt_mcore.app.config import ConfigError
    from scalerlt_mcore.app.plan import parse

    try:
        parse(argv)
    except ConfigError as e:
        return str(e)
    return ""


def _for_workload(cfg, wl: ScaleWorkload):
    """``cfg`` with the workload's S (a tree: its answers and branches), G and one group per
    GPU."""
    cfg = copy.deepcopy(cfg)
    cfg.rl.rl_max_response_length, cfg.rl.grpo_group_size = wl.answer_length, wl.G
    if wl.is_tree:
        cfg.rl.rl_rollout, cfg.rl.rl_tree_branches = "tree", ",".join(map(str, wl.branches))
    cfg.training.global_batch_size = WORLD_SIZE * wl.G
    cfg.training.micro_batch_size = wl.G
    return cfg


def _row(name: str, plan, memory, flops: float, resident: int, gpu: float,
         cache: int = 0, tree=None) -> dict:
    """One schedule's figures; ``plan`` None: no plan fits (``memory`` is the smallest's).
    The per-GPU total: what stays resident, plus the larger of the step and the rollout cache
    freed before it (``cache``). A tree's joint row also gives its plan's retained nodes,
    wave size and prompt segments (the scaled run's plan)."""
    from scalerlt_mcore.app.plan import plan_text

    total = resident + max(memory.peak_bytes, cache)
    fits = plan is not None and total <= gpu
    row = {"schedule": name, "plan": plan_text(plan, tree), "fits": fits,
           "saved_bytes": memory.saved_bytes, "peak_bytes": memory.peak_bytes,
           "total_bytes": total, "shortfall_bytes": max(total - gpu, 0), "flops": flops}
    if tree is not None and name.startswith("joint"):
        row["retain_nodes"] = None if plan is None else list(plan.node_retained(
            tree.num_nodes))
        row["wave_size"] = 1 if plan is None else plan.wave_size
        row["prompt_segments"] = 1 if plan is None else plan.prompt_segments
    return row


def _best_naive(cfg, model, twin, wl, budget: float, R: int):
    """(the largest naive microbatch that fits ``budget`` without recompute, else with MCore's
    full recompute; whether it recomputes) or (None, None)."""
    from scalerlt_mcore.app.plan import _loss_per_position
    from scalerlt_mcore.shared_prefix.planner import Planner

    group = SimpleNamespace(prompt_length=wl.prompt_length, response_length=wl.S,
                            group_size=wl.G, group_id=0, tree=None)
    for recompute, m in ((False, model), (True, twin)):
        planner = Planner("auto", "auto", memory_budget=max(budget, 1.0), schedule="naive",
                          loss_per_position=_loss_per_position(cfg))
        try:
            return planner(group, m, R), recompute
        except ValueError:
            continue
    return None, None


def _naive_flops(m, wl, recompute: bool) -> float:
    """A group's naive step: forward 1 + backward 2 of every row (read out everywhere), plus
    the layers' forward again under full recompute (``app.plan._flops``)."""
    from scalerlt_mcore.shared_prefix.planner import pass_flops

    T = wl.prompt_length + wl.S
    return 3 * pass_flops(m, wl.G, T, 0, readout=True) + recompute * pass_flops(m, wl.G, T, 0)


def full_size(family: Family, workloads=WORKLOADS, log=print) -> list:
    """Every workload of ``family`` planned at full size on meta: one entry per workload. The
    models are built once, in a model-parallel context of the run's TP; what the plan command
    says of each workload comes after that context (``smallest_change`` opens its own)."""
    from scalerlt_mcore.app.plan import meta_model, tp_context

    out, says = [], []
    with tempfile.TemporaryDirectory() as d:
        source = _source(Path(d), family.shape)
        cfg = _family_cfg(family, source)
        with tp_context(cfg):
            start = time.perf_counter()
            model, twin = meta_model(cfg, recompute=False), meta_model(cfg, recompute=True)
            log(f"[scale] {family.name}: built on meta in {time.perf_counter() - start:.1f} s")
            for wl in workloads:
                start = time.perf_counter()
                entry, said = plan_workload(family, source, cfg, model, twin, wl)
                entry["seconds"] = time.perf_counter() - start
                out.append(entry)
                says.append(said)
        for entry, said, wl in zip(out, says, workloads):
            start = time.perf_counter()
            entry["plan_command"] = said()
            entry["seconds"] += time.perf_counter() - start
            log(f"[scale] {family.name} {wl.name}: {summary_line(entry)} "
                f"({entry['seconds']:.1f} s)")
    return out


def plan_workload(family: Family, source: Path, cfg0, model, twin, wl: ScaleWorkload) -> tuple:
    """(``wl``'s rows at full size: the plan command's report, its run planned under the
    budget the GPU leaves (a tree's naive rows: its rows as one-level sequences); what the
    plan command says of it, a function to call outside the models' context)."""
    from scalerlt_mcore.app.plan import (
        Workload,
        make_report,
        plan_text,
        rows_that_fit,
        shortfall,
        smallest_change,
        workload_group,
    )

    cfg, gpu = _for_workload(cfg0, wl), GPU_GIB * GIB
    work = Workload(WORLD_SIZE, wl.prompt_length, gpu, wl.reply_length)
    # where every sample at once does not fit: the most at once that do (the command's change)
    cfg.rl.inference_max_requests = samples = rows_that_fit(cfg, work, model)
    report = make_report(cfg, work, model, twin)
    cfg.shared_prefix.shared_prefix_memory_budget = max(report.budget / 2**20, 1.0)
    report = make_report(cfg, work, model, twin)  # the run's own plan under that budget
    R = cfg.model.looped_num_loops
    held, budget = report.resident_bytes, report.budget
    cache, tree = report.rollout_cache, workload_group(cfg, work).tree
    freed = 0 if held > report.state_bytes else cache
    rows = [_row(r.name, r.plan, r.memory, r.flops, held, gpu, freed, tree)
            for r in report.rows]
    refused = " ".join(plan_command_says(plan_argv(family, source, wl)).split())

    def says() -> str:
        """As the command prints it: with the smallest change that fits (its own contexts)."""
        if shortfall(report):
            report.change = smallest_change(cfg, work)
        line = shortfall(report) or "fits"
        if samples is not None:
            line = f"with --inference-max-requests {samples}: {line}"
        return f"refuses: {refused}; at the shape: {line}" if refused else line

    naive, naive_rc = ((None, None) if report.state_bytes + cache > gpu else
                       _best_naive(cfg, model, twin, wl, budget, R))
    m = _shape(model, R) if naive_rc is False else _shape(twin, R)
    naive_best = None if naive is None else {
        "plan": plan_text(naive) + (", recompute" if naive_rc else ""),
        "flops": _naive_flops(m, wl, naive_rc)}
    joint_best = next((r for r in rows[2:] if r["fits"]), None)
    ratio = (naive_best["flops"] / joint_best["flops"]
             if naive_best and joint_best else None)
    return {"family": family.name, "workload": wl.describe(), "parameters": report.parameters,
            "state": report.state, "state_bytes": report.state_bytes, "rollout_cache": cache,
            "samples_at_once": samples,
            "cache_fits": report.state_bytes + cache <= gpu, "budget_bytes": budget,
            "gpu_bytes": gpu, "rows": rows, "naive_best": naive_best,
            "joint_best": None if joint_best is None else {
                k: joint_best[k] for k in ("schedule", "plan", "flops")},
            "naive_over_joint_flops": ratio,
            "plans": {"joint": _plan_dict(report.rows[2].plan) if not wl.is_tree else None}}, says


def _shape(model, R: int):
    from scalerlt_mcore.shared_prefix.planner import ModelShape

    return ModelShape.from_model(model, R)


def _plan_dict(plan) -> Optional[dict]:
    return None if plan is None else asdict(plan)


def summary_line(e: dict) -> str:
    best = e["joint_best"]
    ratio = e["naive_over_joint_flops"]
    return (f"naive mb1 {e['rows'][0]['total_bytes'] / GIB:.1f} GiB, joint "
            f"{e['rows'][2]['plan']} {e['rows'][2]['total_bytes'] / GIB:.1f} GiB; best joint "
            f"{best['schedule'] if best else 'none'}; naive/joint FLOPs "
            f"{'n/a' if ratio is None else f'{ratio:.2f}'}")


# ---- the tree at full size --------------------------------------------------------------------


def prefix_tree(wl: ScaleWorkload):
    """(the ``PrefixTree`` of ``wl``, per node whether it trains a token, its loss mask [G, T])
    built from the node layout alone (no tokens)."""
    from scalerlt_mcore.shared_prefix.tree import PrefixTree

    from .tree import leaves, tree_nodes

    nodes = tree_nodes(wl.tree_workload())
    tree = PrefixTree(tuple(n.parent for n in nodes), tuple(n.start for n in nodes),
                      tuple(n.end for n in nodes), tuple(leaves(nodes)))
    mask = torch.zeros(wl.G, wl.prompt_length + wl.S)
    for g, leaf in enumerate(tree.leaf_of_row):
        for n in tree.path(leaf)[1:]:
            mask[g, nodes[n].start - 1 : nodes[n].start - 1 + nodes[n].trained] = 1
    return tree, [n.trained > 0 for n in nodes], mask


# ---- scaled down, measured on CPU -------------------------------------------------------------


def _tiny(family: Family, wl: ScaleWorkload, dtype: str = "bf16"):
    """The family's tiny CPU config for ``wl`` (positions for its rows, bf16) and its model."""
    from scalerlt_mcore.app.config import model_config, parse_args
    from scalerlt_mcore.app.pretrained import run_vocab_size
    from scalerlt_mcore.app.runtime import build_model

    argv = ["--config", str(REPO / "configs" / family.tiny), "--rl-max-response-length",
            str(wl.S), "--grpo-group-size", str(wl.G), "--micro-batch-size", str(wl.G),
            "--global-batch-size", str(wl.G), "--max-position-embeddings",
            str(wl.prompt_length + wl.S), f"--{dtype}"]
    cfg = parse_args(argv)
    return cfg, build_model(cfg, model_config(cfg, "cpu"), run_vocab_size(cfg), "cpu")


def _cpu_groups(cfg, model, wl: ScaleWorkload, seed: int = 0) -> tuple:
    """(the rows as one-level sequences for naive, the group joint replay trains)."""
    from . import tree as tree_bench
    from .workloads import Workload, attach_old_logprobs, make_group

    R, V = cfg.model.looped_num_loops, model.vocab_size
    if wl.is_tree:
        twl = wl.tree_workload(num_loops=R, vocab=V)
        segments = tree_bench.make_segments(twl, seed)
        rows = tree_bench.naive_rows(twl, segments, seed)
        rows.old_logprobs = model(rows.tokens, labels=rows.labels).logprobs.detach().float()
        return rows, tree_bench.tree_group(segments, rows)
    group = make_group(Workload(wl.name, wl.G, wl.prompt_length, wl.S, 1, num_loops=R,
                                vocab=V), seed)
    attach_old_logprobs(model, group, seed)
    return group, group


def measured_peak(cfg, model, group, plan) -> int:
    """``SavedTensorProbe``'s peak over one step of the run's schedule training ``group`` by
    ``plan``."""
    from scalerlt_mcore.app.config import objective_from
    from scalerlt_mcore.rl.objective import rl_forward_step
    from scalerlt_mcore.shared_prefix import (
        SavedTensorProbe,
        get_shared_prefix_forward_backward_func,
    )

    schedule = get_shared_prefix_forward_backward_func(
        plan.wave_size, cfg.shared_prefix.shared_prefix_checkpoint_waves,
        chooser=lambda group, model, num_loops=None: plan)
    model.zero_grad(set_to_none=True)
    with SavedTensorProbe(model) as probe:
        schedule(forward_step_func=rl_forward_step(objective_from(cfg)),
                 data_iterator=iter([group]), model=model, num_microbatches=1,
                 num_loops=cfg.model.looped_num_loops, seq_length=group.tokens.shape[1],
                 micro_batch_size=group.tokens.shape[0])
    return int(probe.peak_bytes)


def predicted_saved(cfg, model, wl: ScaleWorkload, plan) -> int:
    """The planner's predicted peak saved bytes of ``plan`` on ``wl``."""
    from scalerlt_mcore.app.plan import _loss_per_position
    from scalerlt_mcore.shared_prefix.planner import plan_memory, tree_memory

    m, loss = _shape(model, cfg.model.looped_num_loops), _loss_per_position(cfg)
    waves = cfg.shared_prefix.shared_prefix_checkpoint_waves
    if wl.is_tree and not plan.naive:
        tree, has_loss, _ = prefix_tree(wl)
        return tree_memory(m, tree, plan, has_loss, loss, waves).saved_bytes
    return plan_memory(m, wl.prompt_length, wl.S, wl.G, plan, waves, loss).saved_bytes


def joint_plan_of(entry: Optional[dict], wl: ScaleWorkload):
    """The full-size joint plan's shape for the scaled run (``entry``: the full-size entry);
    where none fits there, the smallest plan (waves of 1, everything recomputed)."""
    from scalerlt_mcore.shared_prefix.planner import GroupPlan

    if wl.is_tree:
        row = None if entry is None else entry["rows"][2]
        nodes = None if row is None else row.get("retain_nodes")
        if nodes is None:
            return GroupPlan(1, retain_nodes=(False,) * len(prefix_tree(wl)[1]))
        segments = row.get("prompt_segments", 1)
        if segments > 1:
            return GroupPlan(row["wave_size"], retain_nodes=tuple(nodes),
                             prompt_segments=segments)
        return GroupPlan(row["wave_size"], retain=all(nodes), retain_nodes=tuple(nodes))
    plan = None if entry is None else entry["plans"]["joint"]
    return GroupPlan(1) if plan is None else GroupPlan(**plan)


def scaled_down(family: Family, wl: ScaleWorkload, entry: Optional[dict] = None,
                factor: int = SCALE, seed: int = 0) -> dict:
    """``wl`` at 1/``factor`` of its lengths on the family's tiny model: naive micro-batch 1
    and joint replay by the full-size plan's shape, measured beside predicted."""
    from scalerlt_mcore.app.plan import plan_text
    from scalerlt_mcore.shared_prefix.planner import GroupPlan

    small = wl.scaled(factor)
    torch.manual_seed(seed)
    cfg, model = _tiny(family, small)
    rows, group = _cpu_groups(cfg, model, small, seed)
    out = {"family": family.name, "workload": small.describe(), "factor": factor, "runs": []}
    for name, plan, batch in (("naive, micro-batch 1", GroupPlan(1, naive=True), rows),
                              ("joint replay", joint_plan_of(entry, small), group)):
        measured = measured_peak(cfg, model, batch, plan)
        predicted = predicted_saved(cfg, model, small, plan)
        tree = prefix_tree(small)[0] if small.is_tree else None
        out["runs"].append({"schedule": name, "plan": plan_text(plan, tree),
                            "measured": measured,
                            "predicted": predicted, "error": predicted / measured - 1})
    return out


# ---- the whole bench, its targets and tables --------------------------------------------------


def run_scale(families=FAMILIES, workloads=WORKLOADS, factor: int = SCALE, log=print) -> dict:
    """Full size on meta, then scaled down on CPU, for every family x workload."""
    start = time.perf_counter()
    full = [e for f in families for e in full_size(f, workloads, log)]
    by_key = {(e["family"], e["workload"]["name"]): e for e in full}
    scaled = []
    with _mcore():
        for f in families:
            for wl in workloads:
                s = scaled_down(f, wl, by_key.get((f.name, wl.name)), factor)
                scaled.append(s)
                log(f"[scale] {f.name} {wl.name} / {factor}: " + ", ".join(
                    f"{r['schedule']} {r['error']:+.1%}" for r in s["runs"]))
    result = {"full_size": full, "scaled": scaled, "gpu_gib": GPU_GIB,
              "world_size": WORLD_SIZE, "factor": factor}
    result["targets"] = targets(result)
    result["bench_seconds"] = time.perf_counter() - start
    return result


def _mcore():
    """A one-rank MCore model-parallel context, unless the caller holds one."""
    import contextlib

    import torch.distributed as dist

    from scalerlt_mcore.testing import model_parallel_context

    return contextlib.nullcontext() if dist.is_initialized() else model_parallel_context(seed=1)


def _joint_text(best: Optional[dict]) -> Optional[str]:
    """The best joint row's plan, ", recompute" where it is the recompute row's."""
    if best is None:
        return None
    return best["plan"] + (", recompute" if best["schedule"].endswith("recompute") else "")


def targets(result: dict) -> list:
    """#41's targets this bench can judge, each with its figure and whether it is met."""
    out = []
    for e in result["full_size"]:
        fam, name, best = e["family"], e["workload"]["name"], e["joint_best"]
        fits = best is not None and e["cache_fits"]
        if fam == "Ouro-1.4B" or (fam == "Huginn-0125" and name in ("M1", "M2")):
            out.append({"target": f"{fam} {name} fits {GPU_GIB:g} GiB by the planner's own "
                                  f"joint plan", "measured": _joint_text(best), "met": fits})
        if name in ("M2", "M3", "T"):
            ratio = e["naive_over_joint_flops"]
            out.append({"target": f"{fam} {name} naive/joint FLOPs (same budget) >= "
                                  f"{FLOPS_TARGET:g}", "measured": ratio,
                        "met": ratio is not None and ratio >= FLOPS_TARGET and fits})
    worst = max((abs(r["error"]) for s in result["scaled"] for r in s["runs"]), default=0.0)
    out.append({"target": f"predicted peak within {RTOL:.0%} of measured (every scaled run)",
                "measured": worst, "met": worst <= RTOL})
    return out


def _gib(n) -> str:
    return f"{n / GIB:.1f}"


def full_size_table(result: dict) -> str:
    lines = ["| model | workload | schedule | plan | peak GiB | per-GPU total GiB | fits "
             f"{result['gpu_gib']:g} GiB | TFLOP |", "|---|---|---|---|---|---|---|---|"]
    for e in result["full_size"]:
        for r in e["rows"]:
            over = _gib(r["shortfall_bytes"])
            fit = ("yes" if r["fits"] else
                   f"does not fit: the smallest plan is {over} GiB over"
                   if r["plan"] == "none fits" else f"does not fit: {over} GiB over")
            lines.append(f"| {e['family']} | {e['workload']['name']} | {r['schedule']} | "
                         f"{r['plan']} | {_gib(r['peak_bytes'])} | {_gib(r['total_bytes'])} | "
                         f"{fit} | {r['flops'] / 1e12:,.0f} |")
    return "\n".join(lines)


def summary_table(result: dict) -> str:
    lines = ["| model | workload | model state GiB | rollout cache GiB | naive plan | joint plan "
             "| naive / joint FLOPs | the plan command says |", "|---|---|---|---|---|---|---|---|"]
    for e in result["full_size"]:
        nb, jb, ratio = e["naive_best"], e["joint_best"], e["naive_over_joint_flops"]
        joint = _joint_text(jb) or "none fits"
        lines.append(f"| {e['family']} | {e['workload']['name']} | {_gib(e['state_bytes'])} | "
                     f"{_cache_text(e)} | {'none fits' if nb is None else nb['plan']}"
                     f" | {joint} | {'n/a' if ratio is None else f'{ratio:.2f}'} | "
                     f"{e['plan_command']} |")
    return "\n".join(lines)


def _cache_text(e: dict) -> str:
    """The rollout cache in GiB, and the samples decoded at once where not all."""
    rows = e.get("samples_at_once")
    return _gib(e["rollout_cache"]) + ("" if rows is None else f" ({rows} at a time)")


def scaled_table(result: dict) -> str:
    lines = ["| model (tiny) | workload / scale | P | S | G | schedule | plan | measured KiB | "
             "predicted KiB | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["scaled"]:
        w = s["workload"]
        for r in s["runs"]:
            lines.append(f"| {s['family']} | {w['name']} / {s['factor']} | "
                         f"{w['prompt_length']} | {w['S']} | {w['G']} | {r['schedule']} | "
                         f"{r['plan']} | {r['measured'] / 1024:,.0f} | "
                         f"{r['predicted'] / 1024:,.0f} | {r['error']:+.1%} |")
    return "\n".join(lines)


def targets_table(result: dict) -> str:
    lines = ["| target | measured | met |", "|---|---|---|"]
    for t in result["targets"]:
        m = t["measured"]
        shown = f"{m:.3g}" if isinstance(m, float) else (m or "none")
        lines.append(f"| {t['target']} | {shown} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


MD_HEADING = "# Memory at the users' shapes (scale)"


def markdown(result: dict) -> str:
    return (f"{MD_HEADING}\n\n`python -m benchmarks.scale`, {result['bench_seconds']:.0f} s; "
            f"{result['world_size']} GPUs (DP {result['world_size']}), bf16, per-GPU limit "
            f"{result['gpu_gib']:g} GiB. Method: docs/benchmarks.md.\n\n"
            f"{summary_table(result)}\n\n{full_size_table(result)}\n\n"
            f"{scaled_table(result)}\n\n{targets_table(result)}\n")


def write(out: str, result: dict) -> None:
    os.makedirs(out, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "method": "docs/benchmarks.md"}
    with open(os.path.join(out, "scale.json"), "w") as f:
        json.dump({"meta": meta, **result}, f, indent=1, default=str)
    with open(os.path.join(out, "scale.md"), "w") as f:
        f.write(markdown(result))


def main(argv=None) -> int:
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    for category in (UserWarning, DeprecationWarning, FutureWarning):  # MCore's import notes
        warnings.filterwarnings("ignore", category=category)
    result = run_scale()
    write(args.out, result)
    print(markdown(result))
    print(f"scale bench: {result['bench_seconds']:.0f} s; results in {args.out}/scale.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
