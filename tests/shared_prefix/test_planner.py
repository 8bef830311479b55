"""The planner (scalerlt_mcore/shared_prefix/planner.py): predicted saved-activation bytes
against ``SavedTensorProbe`` measurements, prefix-adjoint bytes against the prefix state, the
wave size and prompt mode chosen for a memory budget (exact whatever it picks), the cost
model's calibration and the joint-vs-naive choice, and the app's flags."""

import gc
import tempfile
import weakref

import pytest
import torch
from helpers.exit_gate import _gated
from helpers.reference_huginn import write_huginn_checkpoint, write_retrofit_checkpoint
from helpers.reference_nanbeige import write_nanbeige_checkpoint
from helpers.reference_ouro import write_ouro_checkpoint
from helpers.sp import LossSpec, build_model, grads, joint_step, make_group, naive_step, rel_errors

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.config import LoopedTransformerConfig
from scalerlt_mcore.model.looped_import import looped_gpt_from_pretrained
from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix import naive_step as library_naive_step
from scalerlt_mcore.shared_prefix.planner import (
    CostModel,
    GroupPlan,
    ModelShape,
    Planner,
    adjoint_bytes,
    calibration,
    naive_memory,
    plan_memory,
)
from scalerlt_mcore.testing import run_distributed

PREDICTION_RTOL = 0.10
MEASURED = {}
LOSS_BYTES = LossSpec().objective().saved_per_position
"""The loss's saved tensors per position, which the planner takes from its caller."""


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if MEASURED:
        worst = max(MEASURED.values())
        print(f"\n[planner] worst |predicted / measured - 1| over {len(MEASURED)} "
              f"plans: {worst:.4f}")


def _rope_model(**kw):
    cfg = LoopedTransformerConfig(use_cpu_initialization=True, **kw)
    return LoopedGPTModel(cfg, get_looped_gpt_layer_local_spec(), 48, 64,
                          position_embedding_type="rope")


def _family(write, dtype, **config):
    """A tiny random checkpoint of a public family, imported (the family's own layers: Ouro's
    sandwich norms and exit gate, Huginn's adapter and sandwich norms, Retrofitted Recurrence's
    adapter, Nanbeige's loop-boundary norms), in ``dtype``."""
    def build():
        with tempfile.TemporaryDirectory() as d:
            write(d)
            return looped_gpt_from_pretrained(d, use_cpu_initialization=True, **config).to(dtype)
    return build


# Model variants: (name, builder). Each runs every plan below on two group shapes.
MODELS = {
    "plain-f32": lambda: build_model(R=2, hidden=32, heads=4),
    "arch-f64": lambda: build_model(R=3, arch=True, hidden=32, heads=4).double(),
    "concat-gqa": lambda: build_model(R=2, hidden=32, heads=4, attn="concat",
                                      num_query_groups=2),
    "rms-1layer": lambda: build_model(R=1, hidden=64, heads=4, layers=1,
                                      normalization="RMSNorm"),
    "rope-gqa": lambda: _rope_model(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    num_query_groups=2, looped_num_loops=2),
    # bf16: the waves read fp32 leaves copied from the prefix state
    "plain-bf16": lambda: build_model(R=2, hidden=32, heads=4).to(torch.bfloat16),
    "arch-concat-bf16": lambda: build_model(R=2, arch=True, hidden=32, heads=4,
                                            attn="concat").to(torch.bfloat16),
    # truncated backprop: the first R - k loops run graph-free (no saves, no adjoints there)
    "truncated-f32": lambda: build_model(R=3, hidden=32, heads=4, looped_backprop_loops=1),
    "truncated-arch-bf16": lambda: build_model(R=3, arch=True, hidden=32, heads=4,
                                               looped_backprop_loops=2).to(torch.bfloat16),
    # the exit gate's per-loop head and log-probs, measured on the live model
    "exit-gate-arch-f32": lambda: _gated(R=3, hidden=32, heads=4),
    "exit-gate-truncated-bf16": lambda: _gated(R=3, hidden=32, heads=4,
                                               looped_backprop_loops=2).to(torch.bfloat16),
    # the streamed readout keeps no [.., V] logits: the calibration measures what it keeps
    "streamed-readout-f32": lambda: build_model(R=2, hidden=32, heads=4, looped_readout_tile=16),
    "ouro-streamed-bf16": _family(write_ouro_checkpoint, torch.bfloat16, looped_readout_tile=16),
    # the public families: their own layers, measured on the live model
    "ouro-f32": _family(write_ouro_checkpoint, torch.float32),
    "ouro-bf16": _family(write_ouro_checkpoint, torch.bfloat16),
    "ouro-truncated-f32": _family(write_ouro_checkpoint, torch.float32, looped_backprop_loops=2),
    "huginn-f32": _family(write_huginn_checkpoint, torch.float32),
    "huginn-bf16": _family(write_huginn_checkpoint, torch.bfloat16),
    "retrofit-f32": _family(write_retrofit_checkpoint, torch.float32),
    "retrofit-bf16": _family(write_retrofit_checkpoint, torch.bfloat16),
    "nanbeige-f32": _family(write_nanbeige_checkpoint, torch.float32),
    "nanbeige-bf16": _family(write_nanbeige_checkpoint, torch.bfloat16),
}
SHAPES = ((4, 16, 6), (5, 40, 9))  # (G, P, S)
PLANS = ((GroupPlan(2), False), (GroupPlan(2, retain=True), False), (GroupPlan(2), True),
         (GroupPlan(2, retain=True), True), (GroupPlan(1), False), (GroupPlan(8), False),
         (GroupPlan(3, naive=True), False),
         # prefix states of kind inputs: the waves derive the prefix K/V
         (GroupPlan(2, state_kind="inputs"), False), (GroupPlan(2, state_kind="inputs"), True),
         (GroupPlan(1, retain=True, state_kind="inputs"), False))


def _peak(model, step) -> int:
    model.zero_grad(set_to_none=True)
    with SavedTensorProbe(model) as probe:
        step()
    return probe.peak_bytes


def _run_plan(model, group, plan, ck, spec):
    if plan.naive:
        return library_naive_step(model, [group], rl_forward_step(spec.objective()),
                                  plan.wave_size)
    return joint_step(model, [group], spec, plan.wave_size, checkpoint_waves=ck,
                      chooser=lambda g, m: plan)


@pytest.mark.parametrize("name", list(MODELS))
def test_saved_bytes_prediction_within_10_percent(mcore_single, name):
    model = MODELS[name]()
    shape = ModelShape.from_model(model)
    dtype = next(model.parameters()).dtype
    R = model.config.looped_num_loops
    for kl, (G, P, S) in enumerate(SHAPES):
        spec = LossSpec(kl_coef=0.1 * kl, entropy_weight=0.1 * kl)
        group = make_group(G, P, S, R, seed=G, dtype=torch.promote_types(dtype, torch.float32),
                           kl=bool(kl), vocab=model.vocab_size)
        for plan, ck in PLANS:
            got = _peak(model, lambda: _run_plan(model, group, plan, ck, spec))  # noqa: B023
            pred = plan_memory(shape, P, S, G, plan, ck,
                               spec.objective().saved_per_position).saved_bytes
            err = abs(pred / got - 1)
            MEASURED[(name, G, plan, ck)] = err
            assert err <= PREDICTION_RTOL, (
                f"{name} G={G} P={P} S={S} {plan} ckpt={ck}: predicted {pred} B, "
                f"measured {got} B ({err:.1%})")


TP_MODELS = {
    "arch-gqa-f32": lambda: build_model(R=2, arch=True, hidden=32, heads=4, num_query_groups=2,
                                        tensor_model_parallel_size=2),
    "rms-concat-bf16": lambda: build_model(R=2, hidden=32, heads=4, attn="concat",
                                           normalization="RMSNorm",
                                           tensor_model_parallel_size=2).to(torch.bfloat16),
    "ouro-bf16": _family(write_ouro_checkpoint, torch.bfloat16, tensor_model_parallel_size=2),
    "huginn-f32": _family(write_huginn_checkpoint, torch.float32, tensor_model_parallel_size=2),
    "retrofit-bf16": _family(write_retrofit_checkpoint, torch.bfloat16,
                             tensor_model_parallel_size=2),
    "nanbeige-f32": _family(write_nanbeige_checkpoint, torch.float32,
                            tensor_model_parallel_size=2),
}
"""The GPT layout and each public family, every rank its shards."""


def _tp_errors(rank, world_size, name) -> list:
    """Per plan, |predicted / measured - 1| of this rank's saved bytes at TP = 2."""
    model = TP_MODELS[name]()
    shape = ModelShape.from_model(model)
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    R, errors = model.config.looped_num_loops, []
    for G, P, S in SHAPES:
        group = make_group(G, P, S, R, seed=G, dtype=dtype, vocab=model.vocab_size)
        for plan, ck in PLANS:
            got = _peak(model, lambda: _run_plan(model, group, plan, ck, LossSpec()))  # noqa: B023
            pred = plan_memory(shape, P, S, G, plan, ck, LOSS_BYTES).saved_bytes
            errors.append((abs(pred / got - 1), f"{name} G={G} {plan} ckpt={ck}: predicted "
                                                f"{pred} B, measured {got} B"))
    return errors


@pytest.mark.parametrize("name", list(TP_MODELS))
def test_saved_bytes_prediction_within_10_percent_at_tp2(name):
    """The calibration runs on each rank's shards: what it measures is per GPU."""
    for errors in run_distributed(_tp_errors, 2, name, tensor_model_parallel_size=2):
        worst = max(errors)
        MEASURED[(name, "tp2")] = worst[0]
        assert worst[0] <= PREDICTION_RTOL, f"{worst[1]} ({worst[0]:.1%})"


def test_adjoint_bytes_match_the_prefix_state(mcore_single):
    model = build_model(R=3, arch=True, hidden=32, heads=4, num_query_groups=2)
    P = 11
    state = model(torch.ones(1, P, dtype=torch.long), return_prefix_state=True,
                  readout=False).prefix_state
    numel = sum(t.numel() for t in state.tensors())
    # the adjoints are the leaves' grads: fp32, or fp64 in an fp64 model
    assert adjoint_bytes(ModelShape.from_model(model), P) == numel * 4
    assert adjoint_bytes(ModelShape.from_model(model.double()), P) == numel * 8
    assert adjoint_bytes(ModelShape.from_model(model.to(torch.bfloat16)), P) == numel * 4


@pytest.mark.parametrize("k", [1, 2])
def test_adjoint_bytes_count_only_the_trained_depths(mcore_single, k):
    """Truncated backprop: the adjoints are the grads of the leaves joint replay makes, which
    exist only for the depths of the last k loops (and the prelude) and the boundary."""
    from scalerlt_mcore.model.kv import trained_depths

    model = build_model(R=3, arch=True, hidden=32, heads=4, num_query_groups=2,
                        looped_backprop_loops=k)
    P = 11
    state = model(torch.ones(1, P, dtype=torch.long), return_prefix_state=True,
                  readout=False).prefix_state
    leaves = state.detached_leaves(torch.float32, trained_depths(model.config))
    numel = sum(t.numel() for t in leaves.tensors() if t.requires_grad)
    assert numel < sum(t.numel() for t in state.tensors())
    assert adjoint_bytes(ModelShape.from_model(model), P) == numel * 4


def test_auto_wave_size_picks_the_largest_that_fits_and_stays_exact(mcore_single):
    R, G, P, S = 2, 7, 24, 5
    model = build_model(R=R, arch=True).double()
    shape = ModelShape.from_model(model)
    peaks = {(W, r): plan_memory(shape, P, S, G, GroupPlan(W, retain=r),
                                 loss_per_position=LOSS_BYTES).peak_bytes
             for W in range(1, G + 1) for r in (True, False)}
    budget = peaks[(3, True)]
    W = max(W for W in range(1, G + 1) if min(peaks[(W, True)], peaks[(W, False)]) <= budget)
    assert 3 <= W < G, "the budget must bind"
    group = make_group(G, P, S, R, seed=4, kl=True)
    spec = LossSpec(kl_coef=0.1, loop_weights="progressive")
    model.zero_grad(set_to_none=True)
    naive_losses, _ = naive_step(model, [group], spec, 3)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, "auto", prompt="auto", memory_budget=budget,
                     loss_per_position=LOSS_BYTES)
    assert (int(out[0]["wave_size"]), int(out[0]["retain"])) == (W, peaks[(W, True)] <= budget)
    assert abs(float(out[0]["loss"]) - float(naive_losses[0])) <= 1e-12 * abs(naive_losses[0])
    assert max(rel_errors(grads(model), ref).values()) <= 1e-12


def test_auto_prompt_recomputes_where_only_recompute_fits(mcore_single):
    """A long prompt: recompute's peak (phase 2 holds no prompt graph; the replay holds it
    with the smaller last wave) fits a budget that retain does not at the same wave size."""
    R, G, P, S = 2, 5, 48, 6
    model = build_model(R=R).double()
    shape = ModelShape.from_model(model)
    peaks = {(W, r): plan_memory(shape, P, S, G, GroupPlan(W, retain=r),
                                 loss_per_position=LOSS_BYTES).peak_bytes
             for W in range(1, G + 1) for r in (True, False)}
    W = next(W for W in range(G, 0, -1) if peaks[(W, False)] < peaks[(W, True)]
             and all(min(peaks[(v, True)], peaks[(v, False)]) > peaks[(W, False)]
                     for v in range(W + 1, G + 1)))
    planner = Planner("auto", "auto", peaks[(W, False)], loss_per_position=LOSS_BYTES)
    group = make_group(G, P, S, R, seed=5)
    assert planner(group, model) == GroupPlan(W, retain=False)
    assert Planner("auto", "retain", peaks[(W, False)],
                   loss_per_position=LOSS_BYTES)(group, model).wave_size < W
    model.zero_grad(set_to_none=True)
    naive_step(model, [group], LossSpec(), 2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], LossSpec(), "auto", prompt="auto",
                     memory_budget=peaks[(W, False)], loss_per_position=LOSS_BYTES)
    assert (int(out[0]["wave_size"]), int(out[0]["retain"])) == (W, 0)
    assert max(rel_errors(grads(model), ref).values()) <= 1e-12


def test_budget_below_every_plan_names_group_and_sizes(mcore_single):
    model = build_model(R=2)
    group = make_group(4, 12, 5, 2, seed=1, dtype=torch.float32, group_id=17)
    with pytest.raises(ValueError, match=r"group 17 \(P=12, S=5, G=4\): no joint-replay plan "
                       r"fits the memory budget of 0\.00 MiB; the smallest .* needs"):
        Planner("auto", "auto", 1000, loss_per_position=LOSS_BYTES)(group, model)
    with pytest.raises(ValueError, match="memory_budget must be > 0"):
        Planner("auto", "auto", 0)
    with pytest.raises(ValueError, match="a memory budget: a memory prediction needs "
                       "loss_per_position"):
        Planner("auto", "auto", 1000)  # the planner knows no loss: the caller says its bytes


@pytest.mark.parametrize("kw", [dict(R=2, hidden=64, heads=4),
                                dict(R=3, arch=True, hidden=64, heads=4, num_query_groups=2,
                                     normalization="RMSNorm")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_model_on_meta_calibrates_as_on_a_device(mcore_single, kw, dtype):
    """A full-size model is planned on ``meta`` (no memory, no GPU): its calibration runs the
    fused attention a device runs (``_flash_on_meta``), not SDPA's math kernel with its scores,
    so it predicts what the same model measures on CPU (fused there too), within 2%, in bf16
    and in fp32."""
    cpu = build_model(**kw).to(dtype)
    meta = build_model(**kw).to(dtype).to("meta")
    pred = [naive_memory(ModelShape.from_model(m), 24, 8, 4, 1, LOSS_BYTES).saved_bytes
            for m in (cpu, meta)]
    assert abs(pred[1] / pred[0] - 1) <= 0.02, pred


@pytest.mark.parametrize("recompute", [{}, dict(recompute_granularity="full",
                                                 recompute_method="uniform",
                                                 recompute_num_layers=1)], ids=["none", "full"])
def test_calibration_leaves_no_graph_behind(mcore_single, recompute):
    """Calibration's forwards are never backwarded; nothing of their graphs outlives it: not
    the model's parameters, nor the process groups its layers hold (each a gloo group's
    threads, polling until the process ends)."""
    model = build_model(R=2, arch=True, **recompute)
    weight = weakref.ref(next(model.parameters()))
    assert calibration(model)["token_bytes"]
    del model
    gc.collect()
    assert weight() is None


def test_a_budget_under_activation_recompute_is_refused_with_checkpointed_waves(mcore_single):
    """Under recompute the memory model holds for naive, one-level and tree joint replay
    (test_recompute_plan.py), not with checkpointed waves: no budget is planned there; a
    fixed wave size without a budget, and naive planning, stay."""
    model = build_model(R=2, recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1)
    group = make_group(4, 12, 5, 2, seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"memory_budget cannot plan checkpointed waves under "
                                         r"activation recompute \(recompute_granularity 'full'"):
        Planner("auto", "auto", 2**30, checkpoint_waves=True,
                loss_per_position=LOSS_BYTES)(group, model)
    assert Planner("auto", "auto", 2**30, loss_per_position=LOSS_BYTES)(group, model) == (
        GroupPlan(4, retain=True))
    assert Planner(2, "retain", checkpoint_waves=True)(group, model) == GroupPlan(2, retain=True)
    assert Planner(2, memory_budget=2**30, schedule="naive", naive_micro_batch_size=1,
                   checkpoint_waves=True, loss_per_position=LOSS_BYTES)(group, model).naive


def test_fixed_wave_size_auto_prompt(mcore_single):
    """With a fixed wave size, ``prompt="auto"`` keeps it and retains where that fits (always,
    without a budget)."""
    model = build_model(R=2).double()
    shape = ModelShape.from_model(model)
    G, P, S = 5, 40, 4
    group = make_group(G, P, S, 2, seed=3)
    assert Planner(2, "auto")(group, model) == GroupPlan(2, retain=True)
    tight = plan_memory(shape, P, S, G, GroupPlan(2, retain=True),
                        loss_per_position=LOSS_BYTES).peak_bytes - 1
    assert Planner(2, "auto", tight, loss_per_position=LOSS_BYTES)(group, model) == GroupPlan(
        2, retain=False)
    assert Planner(9, "recompute")(group, model) == GroupPlan(G, retain=False)


def test_cost_model_calibration_leaves_gradients_untouched(mcore_single):
    model = build_model(R=2, hidden=32, heads=4)
    cost = CostModel.calibrate(model, repetitions=1)
    assert cost.call_s > 0 and cost.flop_s >= 0
    assert all(p.grad is None for p in model.parameters())


def test_schedule_auto_picks_naive_for_short_prompts_and_joint_for_long(mcore_single):
    """With a per-call cost that dominates small problems, a short-prompt group goes naive
    (one microbatch: fewest calls) and a long-prompt group joint replay; exact either way."""
    R = 2
    model = build_model(R=R).double()
    cost = CostModel(call_s=1e-4, flop_s=1e-10)
    planner = Planner(2, "auto", schedule="auto", cost_model=cost, naive_micro_batch_size=4)
    short, long_ = make_group(4, 3, 3, R, seed=1, group_id=1), make_group(4, 60, 3, R, seed=2,
                                                                           group_id=2)
    shape = ModelShape.from_model(model)
    assert cost.naive_time(shape, 3, 3, 4, 4) < cost.joint_time(shape, 3, 3, 4, GroupPlan(2))
    assert planner(short, model) == GroupPlan(4, naive=True)
    assert planner(long_, model) == GroupPlan(2, retain=True)
    naive_step(model, [short, long_], LossSpec(), 2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [short, long_], LossSpec(), 2, chooser=planner)
    assert [int(o["naive"]) for o in out] == [1, 0]
    assert max(rel_errors(grads(model), ref).values()) <= 1e-12
    with pytest.raises(ValueError, match="schedule 'auto' needs a cost model"):
        Planner(2, "auto", schedule="auto")


def test_app_flags_parse_and_validate():
    from scalerlt_mcore.app.config import ConfigError, parse_args, schedule_from, validate

    cfg = parse_args(["--shared-prefix-wave-size", "auto", "--shared-prefix-memory-budget",
                      "64", "--shared-prefix-prompt", "retain", "--shared-prefix-schedule",
                      "auto"])
    validate(cfg, world_size=1)
    sp = cfg.shared_prefix
    assert (sp.shared_prefix_wave_size, sp.shared_prefix_memory_budget) == ("auto", 64.0)
    schedule = schedule_from(cfg)  # the budget reaches the library in bytes
    assert isinstance(schedule.chooser, Planner) and schedule.chooser.budget == 64 * 2**20
    assert (schedule.chooser.wave_size, schedule.chooser.prompt) == ("auto", "retain")
    assert parse_args(["--shared-prefix-wave-size", "6"]).shared_prefix.shared_prefix_wave_size == 6
    for argv, message in (
            (["--shared-prefix-wave-size", "auto"],
             "shared_prefix_memory_budget must be set when the wave size is 'auto'"),
            (["--shared-prefix-wave-size", "many"],
             r"shared_prefix_wave_size must be INT or \{auto\}, got 'many'"),
            (["--shared-prefix-wave-size", "0"], "shared_prefix_wave_size must be >= 1, got 0"),
            (["--shared-prefix-memory-budget", "0"], "shared_prefix_memory_budget must be > 0"),
            (["--shared-prefix-prompt", "keep"], "shared_prefix_prompt must be one of")):
        with pytest.raises(ConfigError, match=message):
            validate(parse_args(argv), world_size=1)


def test_trainer_logs_the_plans(mcore_single):
    """The main job with every ``auto``: one RL step trains and logs the chosen plans."""
    from helpers.train_runs import SFT, _flags, _trainer

    tr = _trainer(_flags(shared_prefix_schedule="auto", shared_prefix_wave_size="auto",
                         shared_prefix_memory_budget=16, shared_prefix_prompt="auto"))
    assert isinstance(tr.schedule.chooser, Planner) and tr.schedule.chooser.cost_model
    m = tr.rl_step(SFT)
    assert {"plan_wave_size", "plan_retain", "plan_naive"} <= set(m)
    assert m["plan_wave_size"] >= 1 and 0 <= m["plan_naive"] <= 1


@pytest.mark.parametrize("kl,entropy", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_objective_saved_per_position_is_measured(kl, entropy):
    """``RLObjective.saved_per_position`` (the planner's per-position term of the loss) against
    the bytes autograd saves for ``RLObjective.loss`` on [R, B, T] log-probs (distinct
    storages), per position and per log-prob byte; the [B, T] token weights add the rest."""
    from scalerlt_mcore.rl.objective import RLObjective

    R, B, T = 3, 64, 128
    objective = RLObjective(kl_coef=0.1 * kl, entropy_weight=0.1 * entropy)
    lp = torch.randn(R, B, T).requires_grad_()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        objective.loss(lp, lp.detach() + 0.01, torch.randn(B), torch.rand(B, T),
                       lp.detach() - 0.01 if kl else None)
    measured = sum(storages.values()) / lp.numel() / lp.element_size()
    assert objective.saved_per_position <= measured <= objective.saved_per_position + 0.1
