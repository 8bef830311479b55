"""Log-probs at the sampling temperature: samples drawn at temperature T (with top-p) are
trained with log_softmax(logits / T) in the old, new and reference log-probs (as verl and
OpenRLHF; top-p is not applied to them), whatever the route: the rollout's records (per row,
prompt once, trees), the schedule's scoring, joint replay, the schedule's naive plan,
``naive_step`` and tree replay. Greedy (T = 0) scores at T = 1.

The reference is this file's own: the model's logits (a forward without labels) divided by T,
log-softmaxed and gathered in plain PyTorch. The first PPO epoch's ratio exp(new - old) is 1:
to fp64 rounding (1e-12) with scored old log-probs on an fp64 model, to the rounding of the
rollout's fp32 records with the rollout's.
"""

import pytest
import torch
from helpers.decode import VOCAB, build
from helpers.train_runs import SFT, _flags, _trainer

from scalerlt_mcore.model.vocab_parallel import token_logprobs
from scalerlt_mcore.rl.batch import (
    RLGroup,
    build_groups,
    rollout_old_logprobs,
    tree_old_logprobs,
)
from scalerlt_mcore.rl.objective import RLObjective, rl_forward_step
from scalerlt_mcore.rl.rollout import Sampling, generate
from scalerlt_mcore.rl.tree_rollout import generate_tree, tree_logprobs
from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func, naive_step
from scalerlt_mcore.shared_prefix.scoring import logprobs_forward_step
from scalerlt_mcore.testing import run_distributed

T = 0.7
TOP_P = 0.9
TREE = dict(rl_rollout="tree", rl_tree_branches="2,2", grpo_group_size=4, global_batch_size=8,
            max_position_embeddings=32, rl_task="multiturn",
            rl_task_options={"task": "reverse", "options": {"min_len": 2, "max_len": 3,
                                                            "alphabet": "ab"}})
"""The main job's tree rollouts (tests/app/test_tree_training.py's options)."""
PROMPTS = [[7, 3, 9], [4, 12, 30, 2, 8]]
G, STEPS = 4, 6
EOS, PAD = VOCAB + 1, 0  # an eos the model never draws: every response runs its budget
EPS32 = torch.finfo(torch.float32).eps
SCORED_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
"""|new - scored old| and |scored - plain reference|: fp64 rounding, or fp32 rounding through
the layers (as the decode tests' 1e-5)."""


def _sampling(temperature: float = T, seed: int = 5) -> Sampling:
    return Sampling(temperature=temperature, top_p=TOP_P, banned=(PAD,),
                    generator=torch.Generator().manual_seed(seed))


def _records_tol(dtype, reference: torch.Tensor) -> float:
    """Rollout records (fp32) against an fp64 model: a few fp32 ulps of the largest value."""
    return 4 * EPS32 * reference.abs().max().item() if dtype == torch.float64 else 1e-5


@torch.no_grad()
def plain_logprobs(model, tokens: torch.Tensor, labels: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """[R, B, S]: log_softmax(logits / T) of ``labels`` [B, S] after ``tokens`` [B, S], from the
    model's per-loop logits, in fp64 and plain PyTorch."""
    logits = model(tokens).logits  # R x [B, S, V]
    return torch.stack([torch.log_softmax(lg.double() / temperature, -1)
                        .gather(-1, labels[..., None])[..., 0] for lg in logits])


def _trained(group) -> torch.Tensor:
    return (group.loss_mask != 0)[None]  # [1, G, T]


def _rollout_groups(model, prompt_once: bool, temperature: float = T) -> tuple:
    """(the rollout at ``temperature``, its groups with advantages and the rollout's own old
    log-probs)."""
    ro = generate(model, PROMPTS, G, STEPS, eos_id=EOS, pad_id=PAD, prompt_once=prompt_once,
                  sampling=_sampling(temperature))
    adv = torch.randn(len(PROMPTS), G, generator=torch.Generator().manual_seed(1),
                      dtype=torch.float64)
    groups = build_groups(ro.prompts, ro.responses, ro.lengths, PAD, 0, advantages=adv)
    for n, g in enumerate(groups):
        g.old_logprobs = rollout_old_logprobs(g, ro.loop_logprobs[:, n])
    return ro, groups


def _tree_groups(model) -> tuple:
    """(a sampled depth-2 tree per prompt, its groups with the rollout's old log-probs)."""
    tree = generate_tree(model, PROMPTS, [2, 2], [3, 3], eos_id=EOS, pad_id=PAD,
                         sampling=_sampling())
    groups = []
    for n, segments in enumerate(tree.segments):
        g = RLGroup.from_tree(segments, PAD, group_id=n,
                              advantages=torch.randn(len(tree.leaves[n]), dtype=torch.float64))
        g.old_logprobs = tree_old_logprobs(g, tree.loop_logprobs[n])
        groups.append(g)
    return tree, groups


def _schedule(plan: str):
    return get_shared_prefix_forward_backward_func(
        2, **({"schedule": "naive"} if plan == "naive" else {"prompt": "recompute"}))


def _score(model, groups: list, temperature: float = T) -> list:
    """The trainer's scoring (forward_only through the schedule): per group [R, G, T]."""
    return _schedule("joint_replay")(
        forward_step_func=logprobs_forward_step, data_iterator=iter(groups), model=model,
        num_microbatches=len(groups), seq_length=0, micro_batch_size=1, forward_only=True,
        collect_non_loss_data=True, temperature=temperature)


def capturing(seen: list):
    """The RL loss's forward_step (``rl_forward_step``) that also records, per wave, the new
    log-probs minus the group's old ones on the wave's trained positions."""
    step = rl_forward_step(RLObjective())

    def forward_step(data_iterator, model):
        wave = next(data_iterator)
        output, loss_func = step(iter([wave]), model)

        def loss(out, non_loss_data: bool = False):
            g = wave.group
            old = wave.positions(wave.rows(g.old_logprobs, 1))  # [R, W, T']
            trained = (wave.positions(wave.rows(g.loss_mask)) != 0)[None].expand_as(old)
            seen.append((out.detach() - old.to(out.dtype))[trained])
            return loss_func(out, non_loss_data=non_loss_data)

        return output, loss

    forward_step.check_group = step.check_group
    return forward_step


def _train(model, groups: list, route: str) -> list:
    """One training step of ``groups`` at temperature T by ``route``: the new log-probs minus
    the old ones of every trained position (``capturing``)."""
    seen = []
    if route == "naive_step":
        naive_step(model, groups, capturing(seen), micro_batch_size=2, temperature=T)
    else:
        _schedule(route)(forward_step_func=capturing(seen), data_iterator=iter(groups),
                         model=model, num_microbatches=len(groups), seq_length=0,
                         micro_batch_size=1, temperature=T)
    assert seen and sum(d.numel() for d in seen) > 0
    return seen


@pytest.mark.parametrize("prompt_once", [False, True], ids=["per_row", "prompt_once"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_rollout_records_logprobs_at_the_sampling_temperature(mcore_single, dtype, prompt_once):
    """Every sampled token's per-loop log-probs are log_softmax(logits / T) of the plain
    reference, not those of temperature 1 (which differ by far more)."""
    model, _, _ = build("rope", dtype)
    _, groups = _rollout_groups(model.eval(), prompt_once)
    for g in groups:
        want = plain_logprobs(model, g.tokens, g.labels, T)  # [R, G, T]
        on = _trained(g).expand_as(want)
        err = (g.old_logprobs.double() - want)[on].abs().max().item()
        assert err <= _records_tol(dtype, want[on]), err
        at_one = plain_logprobs(model, g.tokens, g.labels, 1.0)
        assert (at_one - want)[on].abs().max().item() > 1e-2  # the check tells them apart


def test_greedy_rollouts_record_temperature_one(mcore_single):
    """Temperature 0 (greedy) has no sampling distribution: its tokens are recorded at T = 1,
    and the schedule scores them so (no division by zero)."""
    model, _, _ = build("rope", torch.float64)
    _, groups = _rollout_groups(model.eval(), True, temperature=0.0)
    scored = _score(model, groups, temperature=0.0)
    for g, new in zip(groups, scored):
        want = plain_logprobs(model, g.tokens, g.labels, 1.0)
        on = _trained(g).expand_as(want)
        assert (g.old_logprobs.double() - want)[on].abs().max() <= _records_tol(
            torch.float64, want[on])
        assert (new - want)[on].abs().max() <= SCORED_TOL[torch.float64]


@pytest.mark.parametrize("route", ["joint_replay", "naive", "naive_step"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_first_epoch_ratio_is_one_at_the_sampling_temperature(mcore_single, dtype, route):
    """Rollout at T = 0.7 (top-p 0.9), old log-probs scored by the schedule at T: they are the
    plain reference's and the rollout's records; the first training forward's new log-probs
    (joint replay, the schedule's naive plan, ``naive_step``) equal them, ratio 1."""
    model, _, _ = build("rope", dtype)
    _, groups = _rollout_groups(model.eval(), True)
    model.train()
    for g, old in zip(groups, _score(model, groups)):
        want = plain_logprobs(model, g.tokens, g.labels, T)
        on = _trained(g).expand_as(want)
        assert (old.double() - want)[on].abs().max() <= SCORED_TOL[dtype]
        records = g.old_logprobs.double()  # the rollout's
        assert (old.double() - records)[on].abs().max() <= _records_tol(dtype, want[on])
        g.old_logprobs = old
    diff = torch.cat(_train(model, groups, route))
    ratio = diff.double().exp()
    assert (ratio - 1).abs().max() <= SCORED_TOL[dtype], (ratio - 1).abs().max()


@pytest.mark.parametrize("route", ["joint_replay", "naive"])
def test_first_epoch_ratio_against_rollout_records(mcore_single, route):
    """Old log-probs the rollout's own records (``rl_old_logprobs: rollout``), fp64 model: the
    first epoch's ratio is 1 to the records' fp32 rounding."""
    model, _, _ = build("rope", torch.float64)
    _, groups = _rollout_groups(model.eval(), False)
    records = torch.cat([g.old_logprobs[_trained(g).expand_as(g.old_logprobs)] for g in groups])
    model.train()
    diff = torch.cat(_train(model, groups, route))
    assert (diff.exp() - 1).abs().max() <= _records_tol(torch.float64, records)


def test_tree_rollouts_score_and_train_at_the_sampling_temperature(mcore_single):
    """Trees sampled at T: each node's records, teacher-forced ``tree_logprobs`` at T, the
    schedule's scoring and tree replay's first forward all give the plain reference's
    log-probs of every root-to-leaf row (fp64 model, fp32 records)."""
    model, _, _ = build("rope", torch.float64)
    tree, groups = _tree_groups(model.eval())
    forced = tree_logprobs(model, tree.segments, temperature=T)
    model.train()
    for n, (g, old) in enumerate(zip(groups, _score(model, groups))):
        want = plain_logprobs(model, g.tokens, g.labels, T)
        on = _trained(g).expand_as(want)
        tol = _records_tol(torch.float64, want[on])
        assert (g.old_logprobs.double() - want)[on].abs().max() <= tol
        assert (tree_old_logprobs(g, forced[n]).double() - want)[on].abs().max() <= 1e-12
        assert (old - want)[on].abs().max() <= 1e-12
        g.old_logprobs = old
    diff = torch.cat(_train(model, groups, "joint_replay"))
    assert (diff.exp() - 1).abs().max() <= 1e-12


def test_the_step_temperature_is_named_when_wrong(mcore_single):
    """A negative or infinite temperature is refused by name before any compute; a model that
    cannot score at a temperature is named; a refused step leaves the model scoring at 1."""
    model, _, _ = build("rope", torch.float64)
    _, groups = _rollout_groups(model.eval(), True)
    for bad in (-0.5, float("inf")):
        with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
            _score(model, groups, temperature=bad)
    with pytest.raises(TypeError, match="needs a model that scores at a sampling temperature"):
        _schedule("joint_replay")(
            forward_step_func=capturing([]), data_iterator=iter(groups),
            model=torch.nn.Linear(2, 2), num_microbatches=len(groups), seq_length=0,
            micro_batch_size=1, temperature=T)
    groups[0].old_logprobs = None
    with pytest.raises(ValueError, match="training needs advantages and old_logprobs"):
        _train(model.train(), groups, "joint_replay")
    g = groups[1]
    got = model(g.tokens, labels=g.labels).logprobs.detach()
    on = _trained(g).expand_as(got)
    assert (got - plain_logprobs(model, g.tokens, g.labels, 1.0))[on].abs().max() <= 1e-12


@pytest.mark.parametrize("rollout", ["prompt_once", "tree"])
@pytest.mark.parametrize("old", ["score", "rollout"])
def test_the_trainer_trains_at_rl_temperature(mcore_single, old, rollout):
    """The main job at ``--rl-temperature 0.7 --rl-top-p 0.9`` (after its supervised warm-up,
    which makes the two temperatures' log-probs differ by ~0.6): the old and KL-reference
    log-probs it trains with are the plain reference's at T (fp32, 1e-5), and the first update's
    log-probs equal the old ones (``rollout_logprob_max_diff``)."""
    extra = TREE if rollout == "tree" else {}
    tr = _trainer(_flags(rl_temperature=T, rl_top_p=TOP_P, grpo_iterations=1, eval_interval=0,
                         rl_old_logprobs=old, **extra))
    for step in range(SFT):
        tr.sft_step(step)
    optimize, gaps = tr.optimize, []

    def checked(groups, num_loops):
        for g in groups:
            want = plain_logprobs(tr.model, g.tokens, g.labels, T)
            on = _trained(g).expand_as(want)
            at_one = plain_logprobs(tr.model, g.tokens, g.labels, 1.0)
            assert (at_one - want)[on].abs().max() > 0.1  # the check tells them apart
            for got in (g.old_logprobs, g.ref_logprobs):
                gaps.append((got.double() - want)[on].abs().max().item())
        return optimize(groups, num_loops)

    tr.optimize = checked
    metrics = tr.rl_step(SFT)
    assert gaps and max(gaps) <= SCORED_TOL[torch.float32], gaps
    assert metrics["rollout_logprob_max_diff"] <= SCORED_TOL[torch.float32]


def _split_vocab_worker(rank: int, world_size: int) -> tuple:
    """This rank's half of fixed fp64 logits [2, 3, 10] through ``token_logprobs`` at T (MCore's
    vocab-parallel cross entropy): (log-probs, the gradient of their weighted sum wrt the
    half, the whole gradient computed here in plain PyTorch, this rank's slice of it)."""
    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(2, 3, 10, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 10, (2, 3), generator=gen)
    weights = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    half = logits[..., rank * 5:(rank + 1) * 5].clone().requires_grad_(True)
    got = token_logprobs(half, labels, temperature=T)
    (got * weights).sum().backward()
    whole = logits.clone().requires_grad_(True)
    want = torch.log_softmax(whole / T, -1).gather(-1, labels[..., None])[..., 0]
    (want * weights).sum().backward()
    return got.detach(), want.detach(), half.grad, whole.grad[..., rank * 5:(rank + 1) * 5]


def test_split_vocabulary_logprobs_at_the_sampling_temperature():
    """Tensor parallelism: log-probs and gradients of a vocabulary split over 2 ranks at T are
    those of log_softmax(logits / T) of the whole vocabulary (fp64, 1e-12)."""
    for got, want, grad, want_grad in run_distributed(_split_vocab_worker, 2,
                                                      tensor_model_parallel_size=2):
        assert (got - want).abs().max() <= 1e-12
        assert (grad - want_grad).abs().max() <= 1e-12
        assert grad.abs().max() > 0
