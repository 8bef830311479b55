"""RL steps over prefix trees: a multi-turn task's tree rollout (turn-1 answers, the
environment's replies, turn-2 answers) trained as one GRPO group per prompt through the
shared-prefix schedule's tree replay.

- In process, with a per-row reference sampler written on ``generate`` (every node's
  continuations decoded from its whole path as a fresh prompt): the trainer's handling of a
  tree rollout (rewards of the leaves, groups, old log-probs in the rows' layout) is checked
  against the scoring pass of the training model, independently of tree decoding.
- From the command line, ``--rl-rollout tree --rl-tree-branches 2,2`` on the tiny config:
  tree decoding, the tree replay and the multi-turn evaluation end to end."""

import math
from functools import partial

import pytest
import torch
from helpers.train_runs import SFT, TINY, TRAIN, _flags, _records, _run, _trainer

from scalerlt_mcore.app.config.rl import parse_tree_branches
from scalerlt_mcore.app.trainer import TreeSample
from scalerlt_mcore.rl.batch import leaf_answers
from scalerlt_mcore.rl.rollout import Sampling, generate
from scalerlt_mcore.rl.tasks import Problem
from scalerlt_mcore.shared_prefix import TreeSegment
from scalerlt_mcore.testing import model_parallel_context

TREE_OPTIONS = dict(
    rl_rollout="tree", rl_tree_branches="2,2", grpo_group_size=4, global_batch_size=8,
    micro_batch_size=4, max_position_embeddings=32, eval_iters=1, eval_interval=0,
    rl_task="multiturn",
    rl_task_options={"task": "reverse", "options": {"min_len": 2, "max_len": 3,
                                                    "alphabet": "ab"}})


def per_row_tree_rollout(tr, step: int, problems, num_loops=None) -> list:
    """Trees sampled node by node: each node's children are ``generate`` samples of a prompt
    that is the node's whole path; a non-final answer's node holds the answer (trained) and
    the environment's reply (not trained)."""
    branches = parse_tree_branches(tr.cfg.rl.rl_tree_branches)
    prompts = tr._prompts([p.prompt for p in problems])
    reply = tr._reply_fn(problems)
    gen = torch.Generator().manual_seed(step)
    tr.model.eval()
    trees = []
    for n, prompt in enumerate(prompts):
        segments, logprobs, frontier = [TreeSegment(prompt, None)], [None], [(0, prompt)]
        for depth, b in enumerate(branches):
            last, grown = depth == len(branches) - 1, []
            for node, path in frontier:
                ro = generate(tr.model, [path], b, tr.cfg.rl.rl_max_response_length,
                              eos_id=tr.tok.eos_id, pad_id=tr.tok.pad_id, num_loops=num_loops,
                              sampling=Sampling(generator=gen, banned=tr.banned,
                                                vocab_size=tr.tok.vocab_size))
                for i in range(b):
                    L = int(ro.lengths[0, i])
                    answer, lp = ro.responses[0, i, :L].tolist(), ro.loop_logprobs[:, 0, i, :L]
                    env = [] if last else reply(n, path, answer)
                    mask = None if last else [1.0] * L + [0.0] * len(env)
                    segments.append(TreeSegment(answer + env, node, loss_mask=mask))
                    logprobs.append(torch.cat([lp, lp.new_zeros(lp.shape[0], len(env))], -1))
                    grown.append((len(segments) - 1, path + answer + env))
            frontier = grown
        trees.append(TreeSample(segments, logprobs))
    tr.model.train()
    return trees


def fixed_rewards(spread: bool):
    """``RLTrainer.tree_rewards`` with rewards set per leaf: 0 ... 1 (``spread``) or all 0.5
    (every advantage exactly 0)."""

    def rewards(problems, trees, partial=False):
        sizes = [len(leaf_answers(t.segments)) for t in trees]
        return [torch.linspace(0, 1, G, dtype=torch.float64) if spread
                else torch.full((G,), 0.5, dtype=torch.float64) for G in sizes]

    return rewards


def _params(tr) -> list:
    return [p.detach().clone() for p in tr.model.parameters()]


@pytest.mark.parametrize("old_logprobs", ["score", "rollout"])
def test_a_tree_step_trains_with_the_rollout_logprobs_in_the_rows_layout(old_logprobs):
    """Step 0, every advantage zero and the KL reference the policy itself (taken at the first
    RL step): old and reference log-probs are the training forward's bit for bit (scored per
    node, as the tree trains), so the gradient is exactly zero and Adam leaves the weights as
    they were, as for one-level groups. Step 1, rewards that differ: the tree trains."""
    argv = _flags(**TREE_OPTIONS, rl_old_logprobs=old_logprobs,
                  grpo_iterations=1 if old_logprobs == "rollout" else 2)
    with model_parallel_context(TINY["seed"]):
        tr = _trainer(argv)
        tr.tree_rollout = partial(per_row_tree_rollout, tr)
        seen = []
        build = tr._tree_groups
        tr._tree_groups = lambda *a: seen.append(build(*a)) or seen[-1]
        before = _params(tr)
        tr.tree_rewards = fixed_rewards(spread=False)
        still = tr.rl_step(0)
        unchanged = all(torch.equal(p, b) for p, b in zip(tr.model.parameters(), before))
        tr.tree_rewards = fixed_rewards(spread=True)
        metrics = tr.rl_step(1)
    assert still["grad_norm"] == 0 and still["kl"] == 0 and unchanged, still
    groups, rewards = seen[1]
    assert rewards.shape == (8,) and [g.tree.depth for g in groups] == [2, 2]
    # the scoring pass of the model that sampled (score) or the update's first forward
    # (rollout) reads the rollout's log-probs at the same positions: equal to rounding
    assert metrics["rollout_logprob_max_diff"] < 1e-5, metrics
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    moved = max((p.detach() - b).abs().max() for p, b in zip(tr.model.parameters(), before))
    assert moved > 0
    for g in groups:  # the environment's replies are not trained; every answer is
        trained = g.loss_mask.sum(1)
        assert (trained >= 2).all() and g.advantages.shape == (4,)


def test_the_reply_is_the_trees_own_problems():
    """The environment's turn is the problem of the tree's own prompt, also where a path of
    one problem starts with another problem's prompt (which a lookup by prompt prefix would
    take)."""
    with model_parallel_context(TINY["seed"]):
        tr = _trainer(_flags(**TREE_OPTIONS))
    problems = [Problem("ab>", "ba"), Problem("ab>bb-", "aa")]
    reply = tr._reply_fn(problems)
    path = tr._prompts([problems[1].prompt])[0]  # problem 0's prompt + "bb-" as turn 1
    answer = tr.tok.encode("ba")
    own = [tr.tok.encode(tr.task.reply(p, "ba")) for p in problems]
    assert own[0] != own[1]
    assert reply(0, path, answer) == own[0] and reply(1, path, answer) == own[1]


def test_a_tree_run_from_the_command_line(tmp_path):
    """Two warm-up steps and two RL steps over 2,2 trees of the multi-turn task, evaluated
    at the end (greedy first answers, and a greedy two-turn episode)."""
    run_dir = tmp_path / "run"
    argv = _flags(**{**TREE_OPTIONS, "eval_interval": 0}, train_iters=SFT + 2,
                  run_dir=str(run_dir))
    proc = _run(TRAIN + argv, tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(run_dir)
    assert [(r["kind"], r["step"]) for r in records][-3:] == [
        ("train", SFT), ("train", SFT + 1), ("eval", SFT + 2)]
    for r in (r for r in records if r["kind"] == "train"):
        assert r["grad_norm"] > 0 and r["rollout_logprob_max_diff"] < 1e-5, r
        assert 0 <= r["first_answer_reward"] <= 1 and 1 <= r["response_length"] <= 4, r
    assert 0 <= records[-1]["eval_final_reward"] <= 1
    for r in records:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
