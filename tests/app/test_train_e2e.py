"""End to end: the main job ``python -m scalerlt_mcore.train`` on CPU/gloo, and the trainer's
building blocks (``runtime`` + ``RLTrainer``) in process.

- A 2-rank ``torchrun`` job runs to completion (last line, metrics.jsonl, config.yaml, plot,
  checkpoint). The same job run in process on 2 spawned ranks from the same building blocks
  returns each rank's parameters: the ranks hold identical parameters, and they equal the
  torchrun job's checkpoint bit for bit (so the identity holds for that job too).
- Joint replay and naive training (``--shared-prefix-schedule``) from one seed: identical
  rollouts and rewards, gradients equal to rounding at equal parameters at every optimizer
  step, and final parameters within a bound propagated through Adam from the measured
  gradient differences (see ``_AdamBound``).
- SIGTERM mid-run saves a checkpoint; resuming from it reaches bitwise the parameters, Adam
  moments, KL reference, metrics and final reward of an uninterrupted run.
- The KL reference is the policy at the start of RL (after the warm-up): KL 0 at the first RL
  step.
- Bad input fails with a message naming the problem, and a rejected step changes nothing.

Every run uses tests/configs/e2e_tiny.yaml (every key, so the packaged demo does not matter),
in which the model earns partial-credit rewards from its first RL step (a 2-step supervised
warm-up on a 2-letter ``reverse`` task), so gradients, PPO clipping (2 epochs), the KL penalty
and every loop's readout are all active.
"""

import math
import re
import signal
import subprocess
import sys

import pytest
import torch
from helpers.train_runs import ENV, SFT, TINY, TRAIN, _flags, _records, _run, _trainer, _untimed

from scalerlt_mcore.app.config import ConfigError, load_config, parse_args, to_dict
from scalerlt_mcore.app.trainer import TIMED_METRICS
from scalerlt_mcore.testing import _free_port, model_parallel_context, run_distributed

FINAL_LINE = re.compile(r"final mean reward (\d\.\d{3}) after (\d+) steps in \d+ s")


def _torchrun(port: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(port), "-m", "scalerlt_mcore.train"]


def _ok(proc) -> list:
    """The non-empty stdout lines of a run that must have succeeded."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return [line for line in proc.stdout.splitlines() if line.strip()]


# ---- in-process building blocks ------------------------------------------------------------


def _step(trainer, step: int) -> dict:
    return trainer.sft_step(step) if step < SFT else trainer.rl_step(step)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _flat_grad(model) -> torch.Tensor:
    """The reduced gradient (world size 1: a rank's grad buffer holds all of it)."""
    return torch.cat([p.main_grad.reshape(-1) for p in model.parameters()]).clone()


def _adam_state(optimizer, model) -> dict:
    """Adam's moments (flat, in the optimizer's order) and step counts, one rank's optimizer
    holding all of them."""
    (inner,) = getattr(optimizer, "chained_optimizers", [optimizer])
    shards = [s for group in inner.shard_fp32_groups for s in group]
    assert sum(s.numel() for s in shards) == sum(p.numel() for p in model.parameters())
    states = [inner.optimizer.state[s] for s in shards]
    return {"exp_avg": torch.cat([s["exp_avg"].reshape(-1) for s in states]),
            "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1) for s in states]),
            "steps": sorted({float(s["step"]) for s in states})}


def _load(argv: list, ckpt) -> dict:
    """Parameters, Adam state, schedule and KL reference of checkpoint ``ckpt``, loaded on one
    process by the trainer's own loader into a model built from ``argv``."""
    from scalerlt_mcore.app.checkpoint import load_checkpoint

    with model_parallel_context(TINY["seed"]):
        tr = _trainer(argv)
        step = load_checkpoint(ckpt, tr.model, tr.optimizer, tr.scheduler, reference=tr.ref)
        return {"step": step, "params": _flat(tr.model), "num_steps": tr.scheduler.num_steps,
                "ref": _flat(tr.ref.module), "ref_taken_at": tr.ref.taken_at,
                **_adam_state(tr.optimizer, tr.model)}


# ---- 1. two ranks: torchrun smoke run; identical parameters on both ranks -----------------

TWO_RANK_ITERS = 5  # 2 warm-up + 3 RL steps


def _two_rank_job(rank, world_size, argv):
    """What ``train.run`` does on each rank (evaluations aside): returns the flat parameters,
    the initial ones, and this rank's prompts and rewards."""
    tr = _trainer(argv)
    init, seen = _flat(tr.model), []
    rewards = tr.rewards

    def record(problems, rollout, *args, **kwargs):
        out = rewards(problems, rollout, *args, **kwargs)
        seen.append(([p.prompt for p in problems], out))
        return out

    tr.rewards = record
    metrics = [_step(tr, step) for step in range(tr.cfg.training.train_iters)]
    tr.rewards, decoded = rewards, []
    rollout = tr.rollout
    tr.rollout = lambda step, problems, *a, **k: decoded.append(len(problems)) or rollout(
        step, problems, *a, **k)
    return {"params": _flat(tr.model), "init": init, "seen": seen, "metrics": metrics,
            "eval": tr.evaluate(), "decoded": decoded, "eval_rows": tr.eval_rows}


@pytest.fixture(scope="module")
def two_rank_job():
    return run_distributed(_two_rank_job, 2, _flags(train_iters=TWO_RANK_ITERS), timeout=400,
                           mcore_seed=TINY["seed"])


def test_two_ranks_hold_identical_parameters(two_rank_job):
    r0, r1 = two_rank_job
    assert torch.equal(r0["params"], r1["params"]), "ranks diverged"
    assert torch.equal(r0["init"], r1["init"])
    assert (r0["params"] - r0["init"]).abs().max() > 1e-3, "training must move the parameters"
    # the ranks trained on different data, with a learning signal in every RL step
    assert all(a[0] != b[0] for a, b in zip(r0["seen"], r1["seen"]))
    assert len(r0["seen"]) == TWO_RANK_ITERS - SFT
    for m in r0["metrics"][SFT:]:
        assert m["reward_std"] > 0 and m["grad_norm"] > 0, m


def _evaluated(params, eval_rows=None) -> dict:
    """One rank's evaluation of every held-out prompt with ``params`` (``eval_rows`` prompts
    per decode; None: the trainer's)."""
    with model_parallel_context(TINY["seed"]):
        tr = _trainer(_flags(train_iters=TWO_RANK_ITERS))
        torch.nn.utils.vector_to_parameters(params, tr.model.parameters())
        tr.eval_rows = eval_rows or tr.eval_rows
        return tr.evaluate()


def test_two_ranks_evaluate_their_shares_as_one_rank(two_rank_job):
    """Each data-parallel rank decodes half the held-out prompts, in rollouts of at most
    ``eval_rows`` prompts (no more K/V than an RL rollout's); the rewards summed over the ranks
    equal one rank evaluating every prompt with the same weights, in one decode per loop or in
    decodes of 3."""
    r0, r1 = two_rank_job
    assert r0["eval"] == r1["eval"]
    prompts = TINY["eval_iters"] * TINY["global_batch_size"] // TINY["grpo_group_size"]
    loops = TINY["looped_num_loops"]
    for r in (r0, r1):
        assert sum(r["decoded"]) == prompts // 2 * loops and max(r["decoded"]) <= r["eval_rows"]
    for eval_rows in (None, 3):
        one = _evaluated(r0["params"], eval_rows)
        assert one.keys() == r0["eval"].keys()
        for a, b in zip(one["eval_per_loop"], r0["eval"]["eval_per_loop"], strict=True):
            assert math.isclose(a, b, abs_tol=1e-12), (eval_rows, one, r0["eval"])


def test_torchrun_two_ranks_end_to_end(tmp_path, two_rank_job):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = _run(_torchrun(_free_port()) + _flags(
        train_iters=TWO_RANK_ITERS, run_dir="run", save="ckpt", save_interval=TWO_RANK_ITERS),
        tmp_path)
    lines = _ok(proc)
    assert "Overwriting" not in proc.stdout + proc.stderr, "the last checkpoint was written twice"
    assert "data-parallel ranks: 2" in lines[0]
    # MCore's "Transformer Engine / Apex not installed" warnings: said once (rank 0), not 6x2
    assert "not installed" not in proc.stderr
    assert sum("not installed" in line for line in lines) == 1, lines[:3]
    final = FINAL_LINE.fullmatch(lines[-1])
    assert final, f"last line: {lines[-1]!r}"
    assert int(final[2]) == TWO_RANK_ITERS
    records = _records(run_dir)
    assert [(r["kind"], r["step"]) for r in records] == [
        ("eval", 0), ("sft", 0), ("sft", 1), ("train", 2), ("eval", 3), ("train", 3),
        ("train", 4), ("eval", 5)]
    assert final[1] == f"{records[-1]['eval_reward']:.3f}"
    for r in records:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    resolved = to_dict(load_config(run_dir / "config.yaml"))
    assert resolved == {**TINY, "train_iters": TWO_RANK_ITERS, "run_dir": "run", "save": "ckpt",
                        "save_interval": TWO_RANK_ITERS}
    assert (run_dir / "reward_curve.png").read_bytes().startswith(b"\x89PNG")
    assert (ckpt / "latest").read_text() == f"iter_{TWO_RANK_ITERS:07d}"
    # the job's metrics and (loaded on one process) parameters are the in-process job's
    r0, steps = two_rank_job[0], [r for r in records if r["kind"] != "eval"]
    assert len(steps) == len(r0["metrics"])
    for record, m in zip(steps, r0["metrics"]):
        assert _untimed(record, "kind", "step") == _untimed(m)
    saved = _load(_flags(train_iters=TWO_RANK_ITERS), ckpt)
    assert saved["step"] == TWO_RANK_ITERS
    assert torch.equal(saved["params"], r0["params"])


# ---- 2. joint replay vs naive training ------------------------------------------------------

JN_ITERS = 7  # 2 warm-up steps (one optimizer step each) + 5 RL steps x 2 PPO epochs
BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # the trainer's defaults (asserted below)
# Reduced gradients at equal parameters (naive C at joint replay A's parameters), every
# optimizer step: max |g_A - g_C| <= GRAD_RTOL * max |g_C|. The schedules sum the same
# per-token terms in a different order (prompt once + cascade attention + prefix adjoints vs
# full sequences), so each term carries a few fp32 ulps per op through ~10 layer applications
# (<= 1e-6 relative, as in test_joint_replay_ddp.py). A term can exceed the step's largest
# gradient entry: GRPO advantages sum to zero in each group, so the responses' contributions
# cancel; allow 10x for that. (Measured: 4.0e-7; against each tensor's own max, 1.5e-6, in
# parameters whose gradients cancel most.) Any wiring difference (loss
# normalisation, advantages, KL, clip, loop weights, microbatch scaling) is O(1e-2..1).
GRAD_RTOL = 1e-5
# Mean group loss, KL and clip fraction at equal parameters: the loss is a c-weighted sum
# (sum c = 1 per group) of per-token terms of size <= ~3 (|A| ratio + kl_coef k3), each with
# <= 1e-6 relative rounding. (Measured: 2.2e-7.)
LOSS_ATOL = 1e-6
# The Adam bound: fp32 rounding of AdamW's own arithmetic per step, relative to the value (4
# ops, each may round A's and B's slightly different inputs differently by 1 ulp, doubled).
ADAM_ROUNDING = 16 * 2.0**-24
# The bound must be tight: ||bound|| <= this x the distance B moved from its initialisation.
# (Measured after 14 Adam steps: max |p_A - p_B| 1.8e-4 (lr 1e-2), ||p_A - p_B|| = 6.8e-5 and
# ||bound|| = 1.5e-4 of ||p_B - p_0||, max |p_A - p_B| / bound 0.95 (entries with ~0 gradient).)
MAX_BOUND_NORM = 1e-3


class _AdamBound:
    """Elementwise bound on |p_A - p_B| after torch AdamW steps (weight decay 0) from the
    per-step gradient differences e = |g_A - g_B| of two trajectories (B's g, m, v, lr):

        m = b1 m + (1 - b1) g             => Em <- b1 Em + (1 - b1) e
        v = b2 v + (1 - b2) g^2           => Ev <- b2 Ev + (1 - b2) (2 |g| e + e^2)
        D = sqrt(v / bc2) + eps;  |sqrt(v_A) - sqrt(v_B)| <= min(Ev / sqrt(v), sqrt(Ev))
        |m_A / D_A - m / D| <= Em / D_lo + |m| ED / (D D_lo),   D_lo = max(D - ED, eps)
        Ep <- Ep + lr / bc1 * (that)

    plus ADAM_ROUNDING x |value| per step. Why Adam needs this: its update m / sqrt(v) is
    scale-free, so an entry whose gradient is as small as its rounding error (e.g. the key
    bias, whose exact gradient is 0) moves by up to ~lr differently in A and B; the bound is
    tight there (update ~ lr m / eps) and small where |g| >> e. m and v are B's, recomputed
    in fp64 from B's recorded gradients."""

    def __init__(self, numel: int):
        self.Em, self.Ev, self.Ep, self.m, self.v = (
            torch.zeros(numel, dtype=torch.float64) for _ in range(5))
        self.t = 0

    def update(self, g_a, g_b, lr: float, p_b) -> None:
        b1, b2, u = *BETAS, ADAM_ROUNDING
        g, e = g_b.double(), (g_a.double() - g_b.double()).abs()
        self.t += 1
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        self.Em = b1 * self.Em + (1 - b1) * e + u * self.m.abs()
        self.Ev = b2 * self.Ev + (1 - b2) * (2 * g.abs() * e + e * e) + u * self.v
        sqrt_v = self.v.sqrt()
        D = sqrt_v / math.sqrt(bc2) + ADAM_EPS
        ED = torch.minimum(self.Ev / sqrt_v.clamp_min(1e-300), self.Ev.sqrt()) / math.sqrt(bc2)
        ED = ED + u * D
        D_lo = (D - ED).clamp_min(ADAM_EPS)
        Ed = self.Em / D_lo + self.m.abs() * ED / (D * D_lo) + u * (self.m / D).abs()
        self.Ep = self.Ep + lr / bc1 * Ed + u * p_b.double().abs()


def _summary(out: list, groups: list) -> dict:
    from scalerlt_mcore.rl.stats import summarise

    return summarise(out, len(groups))


def test_joint_replay_and_naive_training_agree(mcore_single):
    trainers = {}
    for name, schedule in (("A", "joint_replay"), ("B", "naive"), ("C", "naive")):
        torch.manual_seed(7)
        trainers[name] = _trainer(_flags(shared_prefix_schedule=schedule, clip_grad=0,
                                         train_iters=JN_ITERS))
    A, B, C = trainers.values()
    t = A.cfg.training
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay) == (*BETAS, ADAM_EPS, 0)
    init = _flat(A.model)
    assert torch.equal(init, _flat(B.model)) and torch.equal(init, _flat(C.model))
    rec = {"rollouts": {"A": [], "B": []}, "grads": {"A": [], "B": []}, "lr": [],
           "params_b": [], "grad_err": [], "loss_err": []}
    for name, tr in (("A", A), ("B", B)):
        _record_rollouts(tr, rec["rollouts"][name])
    _record_grads(A, rec["grads"]["A"])
    _record_grads(B, rec["grads"]["B"], rec["lr"], rec["params_b"])
    fb_a = A._forward_backward

    def a_with_c(groups, num_loops):
        """C: naive forward-backward of A's groups at A's current parameters."""
        with torch.no_grad():
            for pc, pa in zip(C.model.parameters(), A.model.parameters()):
                pc.copy_(pa)
        C.ddp.zero_grad_buffer()
        out_c, g_c = C._forward_backward(groups, num_loops), _flat_grad(C.model)
        out_a = fb_a(groups, num_loops)
        g_a = _flat_grad(A.model)
        rec["grad_err"].append(((g_a - g_c).abs().max() / g_c.abs().max()).item())
        sa, sc = _summary(out_a, groups), _summary(out_c, groups)
        rec["loss_err"].append(max(abs(sa[k] - sc[k]) for k in ("loss", "kl")))
        # the same tokens clipped (one more would add >= 1 / tokens ~ 0.01; fp32 ratio ~1e-8)
        assert sa["clip_fraction"] == pytest.approx(sc["clip_fraction"], abs=1e-6)
        return out_a

    A._forward_backward = a_with_c
    for step in range(JN_ITERS):
        ma, mb = _step(A, step), _step(B, step)
        if step >= SFT:
            assert (ma["reward_mean"], ma["reward_std"]) == (mb["reward_mean"], mb["reward_std"])
    for ra, rb in zip(*rec["rollouts"].values()):
        assert torch.equal(ra.responses, rb.responses) and torch.equal(ra.lengths, rb.lengths)
    assert len(rec["rollouts"]["A"]) == JN_ITERS - SFT
    rl_steps = (JN_ITERS - SFT) * TINY["grpo_iterations"]
    assert len(rec["grad_err"]) == rl_steps and len(rec["lr"]) == SFT + rl_steps
    assert max(rec["grad_err"]) <= GRAD_RTOL, f"grad rel errors per step {rec['grad_err']}"
    assert max(rec["loss_err"]) <= LOSS_ATOL, f"loss/kl errors per step {rec['loss_err']}"

    bound = _AdamBound(init.numel())
    for g_a, g_b, lr, p_b in zip(rec["grads"]["A"], rec["grads"]["B"], rec["lr"],
                                 rec["params_b"]):
        bound.update(g_a, g_b, lr, p_b)
    p_a, p_b = _flat(A.model).double(), _flat(B.model).double()
    diff, moved = (p_a - p_b).abs(), (p_b - init.double())
    ratio = torch.where(diff == 0, 0.0, diff / bound.Ep).max().item()
    report = (f"grad rel err <= {max(rec['grad_err']):.2e}, loss/kl err <= "
              f"{max(rec['loss_err']):.2e}; max |p_A - p_B| {diff.max():.3e}, "
              f"||p_A - p_B|| / ||p_B - p_0|| {diff.norm() / moved.norm():.3e}, max diff/bound "
              f"{ratio:.4f}, ||bound|| / ||p_B - p_0|| {bound.Ep.norm() / moved.norm():.3e}")
    print(report)
    assert ratio <= 1.0, report
    assert (bound.Ep >= max(rec["lr"])).sum() == 0, "bound vacuous (a full Adam step)"
    assert bound.Ep.norm() <= MAX_BOUND_NORM * moved.norm(), report
    assert diff.max() > 0, "the trajectories differ by rounding: the bound is exercised"


# Old log-probs from the rollout vs from the scoring pass, at equal parameters: the same
# per-token log-probs computed by decoding (prompt once, one token at a time) and by the
# shared-prefix forward, fp32 rounding through ~10 layer applications (as the decode tests).
ROLLOUT_LOGPROB_ATOL = 1e-5


def test_rollout_modes_and_rollout_logprobs_as_old_logprobs(mcore_single):
    """The main job's RL step with prompt-once rollouts (the default), per-row rollouts, and the
    rollout's own log-probs as old log-probs (no scoring pass), from one seed: the same
    responses; old log-probs and gradients equal to rounding; the rollout-vs-training
    difference logged at rounding level."""
    flags = {"score": {}, "per_row": {"rl_rollout": "per_row"},
             "rollout": {"rl_old_logprobs": "rollout"}}
    seen, metrics = {}, {}
    for name, extra in flags.items():
        torch.manual_seed(7)
        tr = _trainer(_flags(grpo_iterations=1, **extra))
        seen[name] = rec = {"rollouts": [], "grads": [], "groups": [], "scored": []}
        _record_rollouts(tr, rec["rollouts"])
        _record_grads(tr, rec["grads"])
        _record_calls(tr, "_forward_backward", rec["groups"])
        _record_calls(tr, "score", rec["scored"])
        metrics[name] = [_step(tr, step) for step in range(SFT + 1)][-1]
        # scoring: policy and KL reference, or the reference alone with rollout log-probs
        want = [(tr.ref.module,)] if name == "rollout" else [(tr.ddp,), (tr.ref.module,)]
        assert [args[:1] for args in rec["scored"]] == want, name
    ro = {name: rec["rollouts"][0] for name, rec in seen.items()}
    for name in ("per_row", "rollout"):
        assert torch.equal(ro[name].responses, ro["score"].responses), name
        assert torch.equal(ro[name].lengths, ro["score"].lengths), name
    old_diff = 0.0
    [(groups_score, _)], [(groups_ro, _)] = seen["score"]["groups"], seen["rollout"]["groups"]
    for g_score, g_ro in zip(groups_score, groups_ro):
        assert torch.equal(g_score.loss_mask, g_ro.loss_mask)
        trained = (g_ro.loss_mask != 0)[None].expand_as(g_ro.old_logprobs)  # [R, G, T]
        assert (g_ro.old_logprobs[trained] < 0).all() and (g_ro.old_logprobs[~trained] == 0).all()
        diff = (g_ro.old_logprobs - g_score.old_logprobs.float())[trained].abs().max().item()
        old_diff = max(old_diff, diff)
    assert old_diff <= ROLLOUT_LOGPROB_ATOL
    for name in flags:
        assert metrics[name]["rollout_logprob_max_diff"] <= ROLLOUT_LOGPROB_ATOL, name
        for key in TIMED_METRICS:
            assert metrics[name][key] > 0, (name, key)
        phases = sum(metrics[name][f"time_{p}_s"] for p in ("rollout", "score", "train"))
        assert phases <= metrics[name]["time_step_s"]
    g_score, g_ro = seen["score"]["grads"][-1], seen["rollout"]["grads"][-1]
    assert (g_ro - g_score).abs().max() <= GRAD_RTOL * g_score.abs().max()


def _record_calls(trainer, method: str, log: list) -> None:
    """Append the positional arguments of every call of ``trainer.<method>`` to ``log``."""
    inner = getattr(trainer, method)

    def record(*args):
        log.append(args)
        return inner(*args)

    setattr(trainer, method, record)


def _record_rollouts(trainer, log: list) -> None:
    rollout = trainer.rollout

    def record(step, problems, group_size, temperature=None, loop=-1, num_loops=None):
        out = rollout(step, problems, group_size, temperature, loop, num_loops)
        if temperature is None or temperature > 0:  # None: rl_temperature; 0: greedy evals
            log.append(out)
        return out

    trainer.rollout = record


def _record_grads(trainer, grads: list, lrs=None, params=None) -> None:
    """Every optimizer step's reduced gradient (and its learning rate, the parameters after)."""
    step = trainer.optimizer.step

    def record():
        grads.append(_flat_grad(trainer.model))
        if lrs is not None:
            lrs.append(trainer.optimizer.param_groups[0]["lr"])
        out = step()
        if params is not None:
            params.append(_flat(trainer.model))
        return out

    trainer.optimizer.step = record


# ---- 3. SIGTERM, checkpoint, resume == uninterrupted ----------------------------------------

RESUME_ITERS = 8


def test_sigterm_checkpoint_and_resume_match_uninterrupted_run(tmp_path):
    common = _flags(train_iters=RESUME_ITERS, no_plot=True)
    logs = {name: (tmp_path / name).open("w") for name in ("a.out", "a.err", "b1.err")}
    full = subprocess.Popen(TRAIN + common + ["--save", "a_ckpt", "--run-dir", "a_run"],
                            cwd=tmp_path, env=ENV, stdout=logs["a.out"], stderr=logs["a.err"])
    cut = subprocess.Popen(TRAIN + common + ["--save", "b_ckpt", "--save-interval", "3",
                                             "--run-dir", "b_run1"],
                           cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=logs["b1.err"],
                           text=True)
    try:
        seen = []
        for line in cut.stdout:  # the handler is installed before the first step line
            seen.append(line)
            if line.startswith("step"):
                cut.send_signal(signal.SIGTERM)
                break
        seen += cut.communicate(timeout=400)[0].splitlines()
        b1 = _ok(subprocess.CompletedProcess(cut.args, cut.returncode, "\n".join(seen),
                                             (tmp_path / "b1.err").read_text()))
        resumed = _ok(_run(TRAIN + common + ["--load", "b_ckpt", "--save", "b_ckpt",
                                             "--run-dir", "b_run2"], tmp_path))
        full.wait(timeout=400)
    finally:
        for proc in (full, cut):
            proc.kill()
        for f in logs.values():
            f.close()
    stopped = re.fullmatch(r"interrupted: checkpoint saved after step (\d+)", b1[-1])
    assert stopped, f"last line {b1[-1]!r}: did the run end before the signal was handled?"
    k = int(stopped[1])
    assert SFT < k < RESUME_ITERS
    assert (tmp_path / "b_ckpt" / "iter_0000003").is_dir()  # --save-interval 3
    assert (tmp_path / "b_ckpt" / f"iter_{k:07d}").is_dir()
    uninterrupted = _ok(subprocess.CompletedProcess(
        full.args, full.returncode, (tmp_path / "a.out").read_text(),
        (tmp_path / "a.err").read_text()))
    fa, fb = FINAL_LINE.fullmatch(uninterrupted[-1]), FINAL_LINE.fullmatch(resumed[-1])
    assert fa and fb and int(fb[2]) == RESUME_ITERS - k, (uninterrupted[-1], resumed[-1])
    assert fa[1] == fb[1]

    # metrics: every record of the uninterrupted run, timings aside, is the cut or resumed one
    a = _records(tmp_path / "a_run")
    b = _records(tmp_path / "b_run1") + _records(tmp_path / "b_run2")
    untimed = [[_untimed(r) for r in records]
               for records in (a, b)]
    assert untimed[0] == untimed[1]
    # final checkpoints: parameters, Adam moments and counters, LR schedule: bitwise
    sa, sb = (_load(common, tmp_path / d) for d in ("a_ckpt", "b_ckpt"))
    assert sa["step"] == sb["step"] == RESUME_ITERS
    adam_steps = SFT + (RESUME_ITERS - SFT) * TINY["grpo_iterations"]  # warm-up: one each
    assert sa["steps"] == sb["steps"] == [float(adam_steps)]
    assert sa["num_steps"] == sb["num_steps"]
    assert TINY["grpo_kl_beta"] > 0 and sa["ref_taken_at"] == sb["ref_taken_at"] == SFT
    for key in ("params", "exp_avg", "exp_avg_sq", "ref"):
        assert torch.equal(sa[key], sb[key]), f"{key}: max diff {(sa[key] - sb[key]).abs().max()}"


def test_kl_reference_is_the_policy_at_the_start_of_rl(mcore_single):
    """The KL penalty's reference is the policy after the supervised warm-up, not the initial
    weights: at the first RL step (one PPO epoch: its forward runs at the reference's weights)
    the KL is 0 up to rounding; the step after, the penalty is active."""
    tr = _trainer(_flags(grpo_iterations=1))
    assert tr.cfg.rl.grpo_kl_beta > 0 and SFT > 0
    initial = _flat(tr.model)
    for step in range(SFT):
        _step(tr, step)
    warmed = _flat(tr.model)
    first = tr.rl_step(SFT)
    reference = _flat(getattr(tr.ref, "module", tr.ref))
    assert torch.equal(reference, warmed) and not torch.equal(reference, initial)
    second = tr.rl_step(SFT + 1)
    print(f"KL at the first RL step {first['kl']:.3e}, at the second {second['kl']:.3e}")
    # k3 is quadratic in the log-prob difference: fp32 rounding (~1e-7) gives ~1e-14
    assert first["kl"] <= 1e-10, first["kl"]
    assert second["kl"] > 1e-6, second["kl"]


def test_evaluation_prompts_are_held_out(mcore_single):
    """The trainer's evaluation prompts are never drawn for RL steps or the warm-up."""
    from scalerlt_mcore.app.trainer import step_seed

    tr = _trainer(_flags())
    evals = {p.prompt for p in tr.eval_problems()}
    rl = {p.prompt for step in range(500) for p in tr.train_problems(step)}
    warm_up = {prompt for step in range(500) for prompt, _ in
               tr.task.supervised_pairs(step_seed(TINY["seed"], step, 0, 3), 16)}
    assert len(evals) >= 2 and rl and warm_up
    assert not evals & (rl | warm_up), sorted(evals & (rl | warm_up))


# ---- 4. tensor parallelism: torchrun, checkpoint, resume -----------------------------------

TP_ITERS, TP_CUT = 5, 3  # 2 warm-up + 3 RL steps; the resumed run restarts after step 3
TP_TIMEOUT = 600  # a hang guard: a shared 2-core host took 260 s for the job (40 s in steps)


def test_torchrun_tensor_parallel_runs_and_resumes(tmp_path):
    """``--tensor-model-parallel-size 2`` on 2 ranks (DP=1), vocabulary padded as Megatron's
    default pads it (49 -> 256): 5 steps with checkpoints after steps 3 and 5; ``python -m
    scalerlt_mcore.generate`` samples from the checkpoint in one process; a second job
    resumed from the step-3 checkpoint logs bitwise the same steps 4-5 and final evaluation,
    and saves bitwise the same parameters."""
    common = _flags(train_iters=TP_ITERS, tensor_model_parallel_size=2,
                    make_vocab_size_divisible_by=128, no_plot=True)
    full = _ok(_run(_torchrun(_free_port()) + common + [
        "--save", "a_ckpt", "--save-interval", str(TP_CUT), "--run-dir", "a_run"], tmp_path,
        timeout=TP_TIMEOUT))
    assert "data-parallel ranks: 1, tensor-parallel ranks: 2" in full[0]
    assert FINAL_LINE.fullmatch(full[-1]), full[-1]
    # one process samples from the TP=2 checkpoint (generate runs at TP 1 with the run's padded
    # vocabulary and reads the weights only: the optimizer state is laid out for TP 2)
    sampled = _ok(_run([sys.executable, "-m", "scalerlt_mcore.generate", "--load", "a_ckpt",
                        "--prompt", "ab", "--num-samples", "2"], tmp_path, timeout=TP_TIMEOUT))
    assert len([line for line in sampled if line.startswith("loop ")]) == 2, sampled
    cut = tmp_path / "b_ckpt"
    cut.mkdir()
    (tmp_path / "a_ckpt" / f"iter_{TP_CUT:07d}").rename(cut / f"iter_{TP_CUT:07d}")
    (cut / "latest").write_text(f"iter_{TP_CUT:07d}")
    resumed = _ok(_run(_torchrun(_free_port()) + common + [
        "--load", "b_ckpt", "--save", "b_ckpt", "--run-dir", "b_run"], tmp_path,
        timeout=TP_TIMEOUT))
    assert FINAL_LINE.fullmatch(resumed[-1])[1] == FINAL_LINE.fullmatch(full[-1])[1]
    untimed = [[_untimed(r) for r in _records(d)] for d in (tmp_path / "a_run", tmp_path / "b_run")]
    assert [(r["kind"], r["step"]) for r in untimed[1]] == [
        ("train", 3), ("train", 4), ("eval", 5)]
    assert untimed[1] == [r for r in untimed[0] if r["step"] >= TP_CUT and
                          (r["kind"], r["step"]) != ("eval", TP_CUT)]
    for r in untimed[0]:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    params = [_load_params(common, d) for d in (tmp_path / "a_ckpt", cut)]
    assert torch.equal(params[0], params[1])


def _cost_model(rank, world_size, argv) -> tuple:
    cost = _trainer(argv).schedule.chooser.cost_model
    return cost.call_s, cost.flop_s


def test_tensor_parallel_ranks_plan_alike():
    """``--shared-prefix-schedule auto`` under TP=2 on 2 ranks (one data-parallel rank): both
    ranks of the TP group hold rank 0's measured cost model, so they choose the same schedule
    per group (each rank's own timings could send one rank naive and the other joint)."""
    flags = _flags(tensor_model_parallel_size=2, make_vocab_size_divisible_by=128,
                   shared_prefix_schedule="auto")
    costs = run_distributed(_cost_model, 2, flags, tensor_model_parallel_size=2, timeout=500,
                            mcore_seed=TINY["seed"])
    assert costs[0] == costs[1]


def _load_params(argv: list, ckpt):
    """The parameters of a TP=2 checkpoint, loaded on one process into the TP=1 model of the
    same padded vocabulary (distributed checkpoints reshard)."""
    from megatron.core import dist_checkpointing

    with model_parallel_context(TINY["seed"]):
        tr = _trainer(argv + ["--tensor-model-parallel-size", "1",
                              "--make-vocab-size-divisible-by", str(2 * 128)])
        path = ckpt / (ckpt / "latest").read_text()
        state = dist_checkpointing.load({"model": tr.model.sharded_state_dict()}, str(path))
        tr.model.load_state_dict(state["model"])
        return _flat(tr.model)


# ---- 5. bad input ---------------------------------------------------------------------------


def test_cli_unknown_flag_exits_with_message(tmp_path):
    proc = _run(TRAIN + ["--train-iter", "3"], tmp_path, timeout=400)
    assert proc.returncode != 0
    assert "unknown key 'train_iter' on the command line" in proc.stderr
    assert "did you mean 'train_iters'?" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--hidden-sise", "32"], r"unknown key 'hidden_sise' on the command line"),
    (["--train-iters", "three"], r"key 'train_iters' expects int, got 'three'"),
    (["--rl-partial-credit=maybe"], r"key 'rl_partial_credit' expects bool, got 'maybe'"),
    (["--lr", "fast"], r"key 'lr' expects float, got 'fast'"),
    (["--config", "missing.yaml"], r"config file not found: missing.yaml"),
    (["--config", "bad_key.yaml"], r"unknown key 'lr_decay' in bad_key.yaml"),
    (["--config", "bad_type.yaml"], r"key 'num_layers' expects int, got 2.5"),
    (["--tensor-model-parallel-size", "3"],  # the project's message, not MCore's assertion
     r"world size \(1\) must be divisible by tensor_model_parallel_size \(3\)"),
    (["--pipeline-model-parallel-size", "2"], r"pipeline_model_parallel_size must be 1"),
])
def test_main_rejects_bad_config(tmp_path, monkeypatch, argv, message):
    from scalerlt_mcore.app.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "bad_key.yaml").write_text("num_layers: 2\nlr_decay: cosine\n")
    (tmp_path / "bad_type.yaml").write_text("num_layers: 2.5\n")
    with pytest.raises(ConfigError, match=message):  # a run that starts anyway is short
        main(["--train-iters", "1"] + argv)


def test_bad_config_rejected_before_any_process_group(monkeypatch):
    from megatron.core import parallel_state

    from scalerlt_mcore.app import train

    seen = []

    def spy(cfg, world_size):
        seen.append((world_size, torch.distributed.is_initialized(),
                     parallel_state.model_parallel_is_initialized()))
        raise ConfigError("rejected")

    monkeypatch.setattr(train, "validate", spy)
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it
    with pytest.raises(ConfigError, match="rejected"):
        train.main(["--train-iters", "1"])
    assert seen == [(4, False, False)]


def test_global_batch_not_divisible_by_dp_times_group(tmp_path):
    proc = _run(_torchrun(_free_port()) + _flags(global_batch_size=12, train_iters=1),
                tmp_path, timeout=400)
    assert proc.returncode != 0
    assert ("global_batch_size (12) must be divisible by data-parallel size x grpo_group_size "
            "(2 x 4 = 8)") in proc.stdout + proc.stderr


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_rejects_step_without_changing_state(mcore_single, bad):
    tr = _trainer(_flags())
    for step in range(SFT + 1):  # Adam state exists and the RL path has run once
        _step(tr, step)
    before = _full_state(tr)
    reward, calls = tr.task.reward, []

    def poisoned(problem, completion, **kwargs):
        calls.append(problem)
        return bad if len(calls) == 7 else reward(problem, completion, **kwargs)

    tr.task.reward = poisoned
    with pytest.raises(ValueError, match=r"reward is NaN/inf in group 1: step rejected"):
        tr.rl_step(SFT + 1)
    after = _full_state(tr)
    for key in before:
        assert torch.equal(torch.as_tensor(before[key]), torch.as_tensor(after[key])), key
    tr.task.reward = reward  # the trainer is still usable: the same step now trains
    assert tr.rl_step(SFT + 1)["grad_norm"] > 0
    assert not torch.equal(_full_state(tr)["params"], before["params"])


def _full_state(tr) -> dict:
    return {"params": _flat(tr.model), **{k: v for k, v in _adam_state(tr.optimizer,
                                                                       tr.model).items()},
            "num_steps": tr.scheduler.num_steps, "lr": tr.optimizer.param_groups[0]["lr"],
            "grads": _flat_grad(tr.model)}


def test_load_from_a_different_model_config_names_the_mismatch(tmp_path):
    from scalerlt_mcore.app.train import run

    base = _flags(global_batch_size=8, rl_warmup_sft_steps=0, eval_iters=1, no_plot=True,
                  eval_interval=0, run_dir=str(tmp_path / "run"))  # 0: no periodic evaluation
    ckpt = str(tmp_path / "ckpt")
    run(parse_args(base + ["--train-iters", "1", "--save", ckpt]))
    for flags, message in (
        (["--hidden-size", "32"], r"hidden size 64 != 32"),
        (["--looped-num-loops", "3"], r"loops 2 != 3"),
        (["--ffn-hidden-size", "128"], r"linear_fc1.bias \(256,\) != \(128,\)"),
        (["--looped-injection", "linear_concat"], r"decoder.injection.weight absent != "),
        (["--normalization", "RMSNorm"],  # MCore's layer key map names the layernorms
         r"linear_qkv.layer_norm_bias \(64,\) != absent"),
    ):
        with pytest.raises(ValueError, match="different model config.*" + message):
            run(parse_args(base + ["--train-iters", "2", "--load", ckpt] + flags))
    # the matching config resumes (and each failed run cleaned up after itself); a longer run
    # than the checkpoint's has another LR schedule: Megatron-LM's flag says to take its own
    assert set(run(parse_args(base + ["--train-iters", "2", "--load", ckpt,
                                      "--override-opt-param-scheduler", "true"]))) == {
        "eval_reward", "eval_per_loop"}
