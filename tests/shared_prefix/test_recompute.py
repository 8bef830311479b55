"""Activation recompute in the looped block (``model/recompute.py``: MCore's
``recompute_granularity``, ``recompute_method``, ``recompute_num_layers``, ``recompute_modules``).

- Exact: a model with each recompute setting, trained by joint replay (one-level and tree, the
  prompt recomputed or retained) and by naive stock-MCore microbatches, has the loss and the
  gradients of naive stock-MCore training of the same weights WITHOUT recompute (the loss in
  plain PyTorch: tests/helpers/sp.py, tests/helpers/exit_gate.py), fp64 <= 1e-12 relative per
  tensor; with truncated backprop and with the exit gate; at TP=1 and TP=2.
- It saves less: ``SavedTensorProbe`` peaks of a naive microbatch and of a joint-replay step
  fall with full (and selective) recompute.
- Nothing of a step's graph outlives it (a chunk's checkpoint kept every step's K/V once).
- Settings the block cannot honour are refused with one line naming the field.
"""

import gc
from functools import partial

import pytest
import torch
from helpers.exit_gate import _gated, _joint, _naive
from helpers.families import SETTINGS as FAMILY_SETTINGS
from helpers.sp import (
    LossSpec,
    build_model,
    grads,
    joint_step,
    make_group,
    naive_step,
    rel_errors,
    rel_errors_with_zeros,
)
from helpers.tree import DEPTH2, tree_group

from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix.planner import CostModel, Planner
from scalerlt_mcore.testing import run_distributed

TOL = 1e-12
SETTINGS = {
    **FAMILY_SETTINGS,
    # MCore's MLP recompute returns the fc2 bias parameter through its checkpoint (which
    # gives the parameter a grad_fn): a model without linear biases, as Llama's
    "selective-all": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "mlp"], add_bias_linear=False),
}
MEASURED = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for name, err in MEASURED.items():
        print(f"\n[recompute] max relative error {name}: {err:.3e}")


def _pair(build, setting: str) -> tuple:
    """(a model without recompute, its twin with the recompute ``setting`` and the same
    weights), fp64; both take the setting's other fields."""
    extra = {k: list(v) if isinstance(v, list) else v for k, v in SETTINGS[setting].items()}
    shape = {k: v for k, v in extra.items() if not k.startswith("recompute_")}
    reference = build(**shape).double()
    model = build(**extra).double()
    model.load_state_dict(reference.state_dict())
    return reference, model


def _check(name: str, got: dict, ref: dict, zero=frozenset()) -> None:
    errs = rel_errors_with_zeros(got, ref, set(zero))
    worst = max(errs.values())
    MEASURED[name] = max(MEASURED.get(name, 0.0), worst)
    assert worst <= TOL, {n: e for n, e in errs.items() if e > TOL}


def _group(shape: str, R: int, seed: int):
    if shape == "tree":
        return tree_group(DEPTH2, R, seed=seed, kl=True)
    return make_group(5, 8, 4, R, seed=seed, kl=True)


@pytest.mark.parametrize("shape", ["one-level", "tree"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_truncated_backprop_matches_naive_without_recompute(mcore_single, setting, shape):
    """R = 3, the last 2 loops trained; prelude, coda and injection."""
    R = 3

    def build(**extra):
        return build_model(R=R, arch=True, looped_backprop_loops=2, **extra)

    reference, model = _pair(build, setting)
    group = _group(shape, R, seed=5)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
    naive_losses, _ = naive_step(reference, [group], spec, 2)
    ref = grads(reference)
    out = joint_step(model, [group], spec, 2)
    assert abs(float(out[0]["loss"]) - float(naive_losses[0])) <= TOL * abs(float(naive_losses[0]))
    _check(f"joint {shape}", grads(model), ref)
    model.zero_grad(set_to_none=True)
    naive_step(model, [group], spec, 2)  # naive microbatches through the recomputing model
    _check("naive", grads(model), ref)


@pytest.mark.parametrize("shape", ["one-level", "tree"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_exit_gate_matches_naive_without_recompute(mcore_single, setting, shape):
    """The gate's own entropy-regularised term and exit_pdf credit, R = 3."""
    R = 3

    def build(**extra):
        return _gated(R=R, arch=True, **extra)

    reference, model = _pair(build, setting)
    group = _group(shape, R, seed=6)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05)
    naive_loss = _naive(reference, [group], spec, "exit_pdf", 0.5, 0.1, per_mb=2)
    ref = grads(reference)
    out = _joint(model, [group], spec, "exit_pdf", 0.5, 0.1, 2, False)
    assert abs(float(out[0]["loss"]) - naive_loss) <= TOL * abs(naive_loss)
    _check(f"exit gate {shape}", grads(model), ref)


@pytest.mark.parametrize("setting", ["full-uniform-1", "full-block-1", "selective-all"])
def test_retained_prompt_and_checkpointed_waves(mcore_single, setting):
    """The prompt producer with grad (its graph retained) and checkpointed waves, over
    recomputing layers; the embeddings reach no trained loop without injection (k = 1)."""
    R = 3

    def build(**extra):
        return build_model(R=R, looped_backprop_loops=1, **extra)

    reference, model = _pair(build, setting)
    group = make_group(6, 9, 4, R, seed=7, kl=True)
    spec = LossSpec(normalization="token_mean", kl_coef=0.05, loop_weights="progressive")
    naive_step(reference, [group], spec, 3)
    ref = grads(reference)
    cut = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
    for kw in (dict(prompt="retain"), dict(checkpoint_waves=True)):
        model.zero_grad(set_to_none=True)
        joint_step(model, [group], spec, 2, **kw)
        _check("retain / checkpointed waves", grads(model), ref, cut)


def test_auto_plan_with_recompute(mcore_single):
    """The planner's calibration (forward + ``autograd.grad``, which MCore's checkpoint
    refuses) runs without recompute and leaves the model training; the planned step is
    exact."""
    reference, model = _pair(lambda **extra: build_model(R=2, **extra), "full-uniform-1")
    group = make_group(4, 8, 4, 2, seed=9, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
    naive_step(reference, [group], spec, 2)
    planner = Planner(2, "auto", schedule="auto", cost_model=CostModel.calibrate(model),
                      naive_micro_batch_size=4)
    assert model.training
    joint_step(model, [group], spec, 2, chooser=planner)
    _check("auto plan", grads(model), grads(reference))


# ---- tensor parallelism 2 ------------------------------------------------------------------


def _tp_worker(rank: int, world_size: int) -> dict:
    def build(**extra):
        return build_model(R=2, arch=True, hidden=16, heads=4, num_query_groups=2,
                        tensor_model_parallel_size=2, **extra)

    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
    worst = {}
    for setting in ("full-uniform-1", "selective-all"):
        torch.manual_seed(0)
        reference, model = _pair(build, setting)
        for shape in ("one-level", "tree"):
            group = _group(shape, 2, seed=8)
            reference.zero_grad(set_to_none=True)
            naive_step(reference, [group], spec, 2)
            model.zero_grad(set_to_none=True)
            joint_step(model, [group], spec, 2)
            worst[f"{shape} {setting}"] = max(rel_errors(grads(model), grads(reference)).values())
    return worst


def test_tensor_parallel_2_matches_naive_without_recompute():
    reports = run_distributed(_tp_worker, 2, tensor_model_parallel_size=2, timeout=600)
    for rank, worst in enumerate(reports):
        assert max(worst.values()) <= TOL, (rank, worst)
    print(f"\n[recompute TP=2] max relative grad error "
          f"{max(max(w.values()) for w in reports):.3e}")


# ---- memory --------------------------------------------------------------------------------


def _peak(model, step) -> int:
    model.zero_grad(set_to_none=True)
    with SavedTensorProbe(model) as probe:
        step()
    return probe.peak_bytes


@pytest.mark.parametrize("kind", ["naive", "joint"])
def test_recompute_saves_fewer_bytes(mcore_single, kind):
    """One naive microbatch of full sequences, and a joint-replay step (waves of 2, the prompt
    recomputed): the peak saved bytes fall with selective and further with full recompute."""
    R, hidden, heads = 2, 32, 4
    reference = build_model(R=R, arch=True, hidden=hidden, heads=heads, layers=4)
    group = make_group(4, 32, 8, R, seed=0, dtype=torch.float32)
    spec = LossSpec()
    step = naive_step if kind == "naive" else joint_step
    size = 4 if kind == "naive" else 2  # one microbatch of the 4 rows; waves of 2
    peaks = {}
    for setting in (None, "selective", "full-uniform-1", "full-uniform-2"):
        model = reference
        if setting is not None:
            model = build_model(R=R, arch=True, hidden=hidden, heads=heads, layers=4,
                                **SETTINGS[setting])
            model.load_state_dict(reference.state_dict())
        peaks[setting] = _peak(model, partial(step, model, [group], spec, size))
    print(f"\n[recompute saved bytes, {kind}] " + ", ".join(
        f"{s or 'none'} {b} B ({b / peaks[None]:.3f})" for s, b in peaks.items()))
    assert peaks["full-uniform-1"] < peaks["selective"] < peaks[None]
    assert peaks["full-uniform-1"] < 0.6 * peaks[None]


# ---- nothing outlives a step ---------------------------------------------------------------


def _graph_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn)


@pytest.mark.parametrize("setting,prompt,shape", [
    ("full-uniform-1", "recompute", "one-level"), ("full-block-1", "retain", "one-level"),
    ("selective-all", "recompute", "one-level"), ("selective-all", "retain", "one-level"),
    ("full-uniform-1", "recompute", "tree")])
def test_no_graph_outlives_a_step(mcore_single, setting, prompt, shape):
    """After each joint-replay step under recompute no tensor of its graph is alive. A chunk's
    checkpoint once kept a closure over the forward's K/V routing, which holds the K/V recorded
    after it, whose graph holds the checkpoint: a cycle through autograd that no collection
    frees, so every step's K/V (and the model) stayed for good."""
    R = 2
    model = build_model(R=R, arch=True, **SETTINGS[setting]).double()
    spec = LossSpec(kl_coef=0.1)
    before = _graph_tensors()
    joint_step(model, [_group(shape, R, seed=1)], spec, 2, prompt=prompt)
    assert _graph_tensors() == before


# ---- refused settings ----------------------------------------------------------------------


@pytest.mark.parametrize("extra,message", [
    (dict(recompute_method="uniform"),
     "recompute_method 'uniform' .--recompute-method. needs recompute_granularity 'full', "
     "got None"),
    (dict(recompute_granularity="selective", recompute_method="block"),
     "recompute_method 'block' .* needs recompute_granularity 'full', got 'selective'"),
    (dict(recompute_num_layers=2),
     "recompute_num_layers .--recompute-num-layers. needs recompute_granularity 'full', "
     "got None"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0),
     "recompute_num_layers .* must be an integer >= 1 with recompute_granularity 'full', got 0"),
    # a recomputed MLP with a bias: its fc2 bias parameter came back from MCore's checkpoint
    # with the checkpoint as its grad_fn, and the backward re-entered it until memory ran out
    (dict(recompute_granularity="selective", recompute_modules=["mlp"]),
     r"recompute_modules 'mlp' .--recompute-modules mlp. needs add_bias_linear=False "
     r".--disable-bias-linear."),
])
def test_bad_settings_are_refused(mcore_single, extra, message):
    with pytest.raises(ValueError, match=message):
        build_model(R=2, **extra)
