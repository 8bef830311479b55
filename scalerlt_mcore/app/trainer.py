"""The RL loop: rollouts -> verifiable rewards -> group advantages -> joint-replay PPO steps.

With ``rl_rollout: tree`` a rollout is a prefix tree per prompt (``rl_tree_branches``: each
turn's answers branch; a multi-turn task's environment replies between turns), trained as one
GRPO group over its leaves (``tree_advantages``, root baseline) through the shared-prefix
schedule's tree replay.

Every step's prompts and samples derive from (seed, step, data-parallel rank) alone, so a
resumed run draws the same data as an uninterrupted one, and the ranks of a tensor-parallel
group draw the same data. Rollout outputs, rewards and metrics live on the host; groups,
advantages, log-probs, loop weights and warm-up batches on the model's device.
"""

import contextlib
import copy
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from ..mcore_compat import mcore_workaround
from ..model.config import step_num_loops, step_seed
from ..model.decode_graph import DecodeGraphs
from ..rl.advantages import group_advantages, tree_advantages
from ..rl.batch import (
    attach_exit_depths,
    build_groups,
    build_tree_groups,
    first_answers,
    inference_layout,
    leaf_answers,
    recording_drift,
    rollout_old_logprobs,
    trained_drift,
    tree_old_logprobs,
)
from ..rl.objective import rl_forward_step
from ..rl.publish import DirectoryPublisher, latest_version, publish
from ..rl.rollout import Sampling, generate
from ..rl.sft import sft_batch, sft_forward_step
from ..rl.stats import rollout_metrics, summarise, tree_rollout_metrics
from ..rl.tree_rollout import generate_tree
from ..shared_prefix import SavedTensorProbe, logprobs_forward_step
from .config import (
    eval_prompts,
    objective_from,
    prompts_per_step,
    sampling_from,
    schedule_from,
    task_from,
    tokenizer_from,
)
from .config.rl import (
    max_reply_tokens,
    parse_tree_branches,
    rollout_positions,
    task_lengths,
    tree_turns,
)
from .engine import EngineClient, check_engine_records, rollout_of, timeout_s, usable
from .plan import device_budget

TIMED_METRICS = ("tokens_per_s", "time_rollout_s", "time_score_s", "time_train_s",
                 "time_step_s")
"""Metrics of an RL step that are wall-clock measurements (they differ between identical
runs): throughput and the time of each phase, rollout / score / train, and of the whole step."""


@dataclass
class TreeSample:
    """One prompt's rollout tree: ``segments`` (``TreeSegment``s, the root the prompt; the
    model's answers trained, the environment's replies not) and ``node_logprobs`` [N] x
    [R, L_n], the per-loop log-probs of each node's tokens under the rollout's policy (the
    root's unused)."""

    segments: list
    node_logprobs: list


class KLReference:
    """The frozen policy of the KL penalty: the policy at the start of RL (after the supervised
    warm-up), taken by ``take``, or the one a checkpoint saved, given by ``load``."""

    def __init__(self, module):
        self.module = module
        self.taken_at = None
        """The step at whose start it was taken; None: not yet (still the initial weights)."""

    @torch.no_grad()
    def take(self, model, step: int) -> None:
        """Copy ``model``'s weights (bit for bit) into the reference."""
        self.module.load_state_dict(model.state_dict())
        self.taken_at = step

    def load(self, state_dict: dict, taken_at: int) -> None:
        """Weights saved with a checkpoint (keys without their checkpoint prefix)."""
        with torch.no_grad():
            self.module.load_state_dict(state_dict)
        self.taken_at = taken_at


def decode_graphs_for(cfg, device: torch.device):
    """The decode graphs rollouts keep across steps (``rl_decode_cuda_graph``; False: eager
    decoding); a run off CUDA that asks for them is refused by name."""
    if not cfg.rl.rl_decode_cuda_graph:
        return False
    if device.type != "cuda":
        raise ValueError(f"rl_decode_cuda_graph needs a CUDA device (decode steps are captured "
                         f"as CUDA graphs); this run is on {device.type}")
    return DecodeGraphs()


class RLTrainer:
    """GRPO/PPO over all-loop readouts of a looped GPT on MCore DDP + distributed Adam."""

    def __init__(self, cfg, model, ddp, optimizer, scheduler, publish: bool = True):
        """``publish`` False: a decoder only (``app/engine.py``'s engine), which neither
        publishes nor asks an engine."""
        self.cfg, self.model, self.ddp = cfg, model, ddp
        self.device = next(model.parameters()).device
        self.optimizer, self.scheduler = optimizer, scheduler
        # data are drawn per data-parallel rank: identical on the ranks of a TP group
        self.rank = parallel_state.get_data_parallel_rank()
        self.world = parallel_state.get_data_parallel_world_size()
        self.tok = tokenizer_from(cfg)
        self.task = task_from(cfg)
        self.objective = objective_from(cfg)
        self.forward_step = rl_forward_step(self.objective)
        self.train_drift = []  # rollout-vs-training log-prob differences of the current step
        if cfg.rl.rl_old_logprobs == "rollout":
            self.forward_step = recording_drift(self.forward_step, self.train_drift)
        turns = tree_turns(cfg.rl)
        self.reply_tokens = max_reply_tokens(self.task, self.tok) if turns > 1 else 0
        # positions after the prompt: every turn's answer and, between turns, a reply
        self.path_tokens = turns * cfg.rl.rl_max_response_length + (turns - 1) * self.reply_tokens
        # before the KL reference and Adam's moments exist (device_budget leaves room for them)
        longest = 1 + task_lengths(self.task, self.tok)[0] + self.path_tokens  # bos, prompt, path
        self.default_budget = device_budget(cfg, model, self.device, dist.get_world_size(),
                                            longest)  # bytes; None: the flag's, or none
        self.schedule = schedule_from(cfg, model, self.objective.saved_per_position,
                                      max_response_length=self.path_tokens,
                                      default_budget=self.default_budget)
        # the weights are replaced by the policy's at the first RL step (``_take_reference``)
        self.ref = KLReference(self._frozen_copy(model)) if self.objective.kl_coef > 0 else None
        self.groups_per_rank = prompts_per_step(cfg) // self.world
        # an evaluation's decode holds no more K/V than an RL step's rollout
        prompt = longest - self.path_tokens
        self.eval_rows = max(1, rollout_positions(cfg.rl, prompt, self.reply_tokens,
                                                  self.groups_per_rank) // longest)
        # never sampled; nor the ids past the tokenizer's (a pretrained vocabulary, Megatron's
        # padding): ``Sampling.vocab_size``
        self.banned = (self.tok.pad_id, self.tok.bos_id)
        self.decode_graphs = decode_graphs_for(cfg, self.device)
        rl = cfg.rl
        self.engine = (EngineClient(rl.rl_engine_dir, self.rank, timeout_s(cfg))
                       if publish and rl.rl_rollout_source == "engine" else None)
        self.publish_dir = (None if not publish else rl.rl_publish_dir if self.engine is None
                            else str(self.engine.weights))
        self.publisher = (DirectoryPublisher(self.publish_dir, model)
                          if self.publish_dir and dist.get_rank() == 0 else None)
        self.engine_stats: dict = {}

    def publish(self) -> Optional[int]:
        """The policy as the next weight version of ``publish_dir`` (rank 0 writes; every
        rank waits for it) -> the version (None: no publication)."""
        if self.publish_dir is None:
            return None
        version = None
        if self.publisher is not None:
            version = (latest_version(self.publisher.root) or 0) + 1
            publish(self.model, self.publisher, version)
        dist.barrier()
        return version

    def start_step(self, step: int, evaluation: bool = False) -> int:
        """The loop count of ``step``, computed once here and passed to every rollout, scoring
        and training call of the step: ``step_num_loops`` (the ``looped_loops_warmup_iters``
        curriculum, then ``looped_num_loops_sampling``'s draw for the step; ``evaluation``: the
        largest count it can draw, so that every loop count's accuracy is measured). Also sets
        the step's draw of a random initial state (``looped_initial_state random``) in the
        policy and the KL reference alike: the same s_0 for the step's rollouts, scoring and
        joint replay. No config is changed."""
        m, seed = self.cfg.model, self.cfg.training.seed
        for module in (self.model, *([self.ref.module] if self.ref is not None else [])):
            module.set_initial_state_draw(seed, step)
        return step_num_loops(step, m.looped_num_loops, m.looped_loops_warmup_iters,
                              m.looped_num_loops_sampling, seed, evaluation)

    @staticmethod
    @mcore_workaround
    def _frozen_copy(model):
        """A frozen copy of the weights. MCore modules hold process groups (which cannot be
        copied) and the config holds the DDP hooks: the copy shares both (ledger row W4)."""
        memo = {id(model.config): model.config}
        for module in model.modules():
            for value in vars(module).values():  # e.g. tp_group, pg_collection.dp
                for obj in (value, *getattr(value, "__dict__", {}).values()):
                    if isinstance(obj, dist.ProcessGroup):
                        memo[id(obj)] = obj
        ref = copy.deepcopy(model, memo).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # ---- data ------------------------------------------------------------------------------

    def _prompts(self, texts) -> list:
        """Token lists of prompt strings, each led by bos; a prompt too long for the position
        table with a full response is an error naming it."""
        room = self.cfg.model.max_position_embeddings - self.path_tokens
        prompts = [[self.tok.bos_id] + self.tok.encode(t) for t in texts]
        for text, p in zip(texts, prompts):
            if len(p) > room:
                raise ValueError(f"prompt {text[:60]!r} is {len(p)} tokens with bos: more than "
                                 f"max_position_embeddings - rl_max_response_length per turn "
                                 f"and the replies between turns ({room})")
        return prompts

    def sampling(self, step: int, **given) -> Sampling:
        """How step ``step`` draws tokens: the run's sampling (``sampling_from``) with the
        step's generator, the banned ids and the tokenizer's vocabulary; ``given``: a call's
        own values (temperature, readout loop)."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(step_seed(self.cfg.training.seed, step, self.rank, 7))
        return sampling_from(self.cfg, generator=gen, banned=self.banned,
                             vocab_size=self.tok.vocab_size, **given)

    def rollout(self, step: int, problems, group_size: int, temperature=None, loop: int = -1,
                num_loops=None, exit_kv: bool = False):
        """``group_size`` samples per problem with ``num_loops`` loops (None: the config's)
        from readout ``loop`` at ``temperature`` (None: ``rl_temperature``; 0 greedy);
        ``exit_kv``: as a serving engine keeps an early exit's K/V (``Sampling.exit_kv``:
        the engine process's rollouts with ``rl_rollout_exit`` threshold)."""
        given = {} if temperature is None else {"temperature": temperature}
        given.update({"exit_kv": True} if exit_kv else {})
        self.model.eval()
        out = generate(self.model, self._prompts([p.prompt for p in problems]), group_size,
                       self.cfg.rl.rl_max_response_length, eos_id=self.tok.eos_id,
                       pad_id=self.tok.pad_id,
                       sampling=self.sampling(step, loop=loop, **given),
                       prompt_once=self.cfg.rl.rl_rollout in ("prompt_once", "tree"),
                       num_loops=num_loops, prompt_kv=self.cfg.rl.rl_prompt_kv,
                       cuda_graph=self.decode_graphs,
                       max_rows=self.cfg.rl.inference_max_requests)
        self.model.train()
        return out

    def tree_rollout(self, step: int, problems, num_loops=None, branches=None,
                     temperature=None) -> list:
        """One prefix tree per problem (``TreeSample``) with ``branches`` (default
        ``rl_tree_branches``) at ``temperature`` (default ``rl_temperature``; 0 greedy), the
        task's replies between turns (a multi-turn task's), ``num_loops`` loops: the one call
        of tree decoding (``rl/tree_rollout.py``), adapted to ``TreeSample`` here."""
        given = {} if temperature is None else {"temperature": temperature}
        prompts = self._prompts([p.prompt for p in problems])
        self.model.eval()
        out = generate_tree(
            self.model, prompts, branches or parse_tree_branches(self.cfg.rl.rl_tree_branches),
            self.cfg.rl.rl_max_response_length, eos_id=self.tok.eos_id, pad_id=self.tok.pad_id,
            sampling=self.sampling(step, **given), num_loops=num_loops,
            reply_fn=self._reply_fn(problems), max_rows=self.cfg.rl.inference_max_requests)
        self.model.train()
        return [TreeSample(out.segments[n], out.loop_logprobs[n]) for n in range(len(prompts))]

    def _reply_fn(self, problems):
        """The environment's turn of tree decoding (``rl/tree_rollout.ReplyFn``): (the index of
        the tree's problem in ``problems``, the path's tokens before the answer, the answer's
        ids) -> the reply's ids; None for a single-turn tree."""
        if tree_turns(self.cfg.rl) == 1:
            return None

        def reply(prompt: int, path: list, answer: list) -> list:
            return self.tok.encode(self.task.reply(problems[prompt], self.tok.decode(answer)))

        return reply

    def tree_rewards(self, problems, trees: list, partial: bool = False) -> list:
        """Per tree, the verifiable rewards [G_n] of its leaves (their final answers)."""
        return [torch.tensor([self.task.reward(p, self.tok.decode(answer), partial_credit=partial)
                              for answer in leaf_answers(t.segments)],
                             dtype=torch.float64, device="cpu")
                for p, t in zip(problems, trees)]

    def first_answer_rewards(self, problems, trees: list) -> torch.Tensor:
        """The rewards of every tree's first answers (the root's children), before any reply:
        what a multi-turn task's later turns improve on."""
        partial = self.cfg.rl.rl_partial_credit
        return torch.tensor([self.task.reward(p, self.tok.decode(answer), partial_credit=partial)
                             for p, t in zip(problems, trees)
                             for answer in first_answers(t.segments)], dtype=torch.float64,
                            device="cpu")

    def rewards(self, problems, rollout, partial: bool = False) -> torch.Tensor:
        """[N, G] verifiable rewards of the decoded responses (exact match unless ``partial``)."""
        return torch.tensor([
            [self.task.reward(p, self.tok.decode(r.tolist()), partial_credit=partial)
             for r in rollout.responses[n]]
            for n, p in enumerate(problems)
        ], dtype=torch.float64, device="cpu")

    def _run_schedule(self, model, groups: list, forward_step_func, num_loops: int,
                      forward_only: bool = False) -> list:
        """The shared-prefix schedule over ``groups``, one group per microbatch, with
        ``num_loops`` loops; every log-prob (old, reference, new) at the temperature of the run's
        sampling (``sampling_from``: the rollouts' own), as the rollouts record them."""
        return self.schedule(forward_step_func=forward_step_func, data_iterator=iter(groups),
                             model=model, num_microbatches=len(groups), num_loops=num_loops,
                             temperature=sampling_from(self.cfg).temperature,
                             seq_length=groups[0].tokens.shape[1],
                             micro_batch_size=groups[0].group_size, forward_only=forward_only,
                             collect_non_loss_data=forward_only)

    def score(self, model, groups: list, num_loops: int) -> list:
        """forward_only through the shared-prefix schedule: per-loop log-probs [R, G, T]."""
        return self._run_schedule(model, groups, logprobs_forward_step, num_loops,
                                  forward_only=True)

    # ---- one RL step -----------------------------------------------------------------------

    def train_problems(self, step: int) -> list:
        """This rank's problems of RL step ``step``, from the task's training split."""
        return self.task.sample(step_seed(self.cfg.training.seed, step, self.rank),
                                self.groups_per_rank)

    def eval_problems(self) -> list:
        """The fixed evaluation problems, from the task's evaluation split: no training draw
        (RL or warm-up) produces one of their prompts."""
        return self.task.sample(step_seed(self.cfg.training.seed, 10**6, 0),
                                eval_prompts(self.cfg), split="eval")

    def _take_reference(self, step: int) -> None:
        """At the first RL step (not taken, not loaded): the KL reference becomes the policy."""
        if self.ref is not None and self.ref.taken_at is None:
            self.ref.take(self.model, step)

    def rl_step(self, step: int) -> dict:
        """Rollout -> rewards -> scoring (old/ref log-probs) -> ``grpo_iterations`` updates; the
        wall time of each phase is in the metrics (``TIMED_METRICS``)."""
        t0 = time.perf_counter()
        loops = self.start_step(step)
        self._take_reference(step)
        problems = self.train_problems(step)
        sample, to_groups, layouts, metrics = (  # the rollout's kind: trees or one level
            (self._sample_trees, self._tree_groups, self._tree_layouts, self._tree_metrics)
            if self.cfg.rl.rl_rollout == "tree" else
            (self._engine_sample if self.engine else self._sample, self._groups,
             self._layouts, lambda p, r, ro: rollout_metrics(r, ro)))
        problems, ro = sample(step, problems, loops)
        t_rollout = time.perf_counter()
        groups, rewards = to_groups(step, problems, ro)
        t_score = time.perf_counter()
        drift = self._attach_logprobs(groups, layouts(groups, ro), loops)
        t_train = time.perf_counter()
        self.train_drift.clear()
        train = self.optimize(groups, loops)
        if self.cfg.rl.rl_old_logprobs == "rollout":
            drift = float(torch.stack(self.train_drift).max())
        tokens = float(sum(g.loss_mask.sum() for g in groups))
        t_end = time.perf_counter()
        rollout = metrics(problems, rewards, ro)
        return self._reduce({
            **rollout, **train, **self.engine_stats, "rollout_logprob_max_diff": drift,
            "tokens_per_s": tokens / (t_end - t0), "time_rollout_s": t_rollout - t0,
            "time_score_s": t_train - t_score, "time_train_s": t_end - t_train,
            "time_step_s": t_end - t0, "loops": loops,
        })

    def _sample(self, step: int, problems, num_loops: int) -> tuple:
        """A one-level rollout: ``grpo_group_size`` responses per problem -> (the problems,
        the rollout)."""
        G = self.cfg.rl.grpo_group_size
        return problems, self.rollout(step, problems, G, num_loops=num_loops)

    def _sample_trees(self, step: int, problems, num_loops: int) -> tuple:
        return problems, self.tree_rollout(step, problems, num_loops=num_loops)

    def _engine_sample(self, step: int, problems, num_loops: int) -> tuple:
        """``_sample`` from the engine: step ``step``'s records (asked for now, or a step
        before with lag >= 1), checked, stale ones refused or dropped; then the next step
        asked for (decoded while this one trains when the lag allows it) -> (the problems of
        the groups kept, their rollout)."""
        rl, e = self.cfg.rl, self.engine
        version, lag = e.version(), rl.rl_max_policy_lag
        self._ask(step, max(1, version - lag))
        records = e.records(step)
        check_engine_records(records, self, version, num_loops)
        kept = usable(records, version, lag, rl.rl_stale_records, step)
        if step + 1 < self.cfg.training.train_iters:
            self._ask(step + 1, max(1, version + 1 - lag))
        groups = sorted({r.group for r in kept})
        self.engine_stats = {
            "engine_dropped_groups": float(len(problems) - len(groups)),
            "policy_lag": float(sum(version - r.weight_version for r in kept) / len(kept))}
        problems = [problems[g] for g in groups]
        prompts = self._prompts([p.prompt for p in problems])
        return problems, rollout_of(kept, prompts, rl.grpo_group_size, self.tok.pad_id,
                                    num_loops)

    def _ask(self, step: int, min_version: int) -> None:
        self.engine.request(step, step_seed(self.cfg.training.seed, step, self.rank),
                            self.groups_per_rank, self.cfg.rl.grpo_group_size, min_version)

    def _groups(self, step: int, problems, ro) -> tuple:
        """(one-level groups of a rollout with their GRPO advantages, rewards [N, G])."""
        rewards = self.rewards(problems, ro, self.cfg.rl.rl_partial_credit)
        advantages = group_advantages(rewards, self.cfg.rl.rl_advantage)  # rejects NaN/inf
        groups = build_groups(ro.prompts, ro.responses, ro.lengths, self.tok.pad_id, step,
                              self.device, advantages)
        return attach_exit_depths(groups, ro.exit_depths), rewards

    def _tree_groups(self, step: int, problems, trees: list) -> tuple:
        """(tree groups of a tree rollout, each one GRPO group over its leaves, the rewards of
        every leaf)."""
        rewards = self.tree_rewards(problems, trees, self.cfg.rl.rl_partial_credit)
        advantages = [tree_advantages(r, [s.parent for s in t.segments], self.cfg.rl.rl_advantage)
                      for r, t in zip(rewards, trees)]  # [G_n] each; rejects NaN/inf
        return build_tree_groups([t.segments for t in trees], self.tok.pad_id, step,
                                 self.device, advantages), torch.cat(rewards)

    def _layouts(self, groups: list, ro) -> list:
        """Per group, the rollout's per-loop log-probs in the group's layout [R, G, T]."""
        return [rollout_old_logprobs(g, ro.loop_logprobs[:, n]) for n, g in enumerate(groups)]

    def _tree_layouts(self, groups: list, trees: list) -> list:
        """``_layouts`` of tree groups: the rollout's per-node log-probs laid out in the rows."""
        return [tree_old_logprobs(g, t.node_logprobs) for g, t in zip(groups, trees)]

    def _tree_metrics(self, problems, rewards, trees: list) -> dict:
        return {**tree_rollout_metrics(rewards, *zip(*((t.segments, t.node_logprobs)
                                                       for t in trees))),
                "first_answer_reward": self.first_answer_rewards(problems, trees).mean().item()}

    def _attach_logprobs(self, groups, rollout: list, num_loops: int) -> float:
        """old (and ref) log-probs; ``rollout``: each group's rollout log-probs in its layout
        (``_layouts``). Returns max |rollout - training forward| log-prob over the trained
        positions (with ``rl_old_logprobs: rollout`` the old log-probs are the rollout's and
        the difference is measured in the update instead: 0 here)."""
        from_rollout = self.cfg.rl.rl_old_logprobs == "rollout"
        old = None if from_rollout else self.score(self.ddp, groups, num_loops)
        ref = (self.score(self.ref.module, groups, num_loops) if self.ref is not None
               else [None] * len(groups))
        correct = self.objective.inference_is_correction
        for n, g in enumerate(groups):
            g.old_logprobs = rollout[n] if from_rollout else old[n].detach()
            g.ref_logprobs = ref[n]
            g.inference_logprobs = inference_layout(g, rollout[n]) if correct else None
        return float(torch.stack([trained_drift(g, r) for g, r in zip(groups, rollout)]).max())

    def optimize(self, groups: list, num_loops: int) -> dict:
        """``grpo_iterations`` optimizer steps on the groups with ``num_loops`` loops; the last
        one's stats."""
        for _ in range(self.cfg.rl.grpo_iterations):
            probe = SavedTensorProbe(self.model)
            out, grad_norm = self._optimizer_step(
                lambda: self._forward_backward(groups, num_loops), probe)
        return {**summarise(out, len(groups)), "grad_norm": grad_norm,
                "peak_saved_bytes": probe.peak_bytes,
                "lr": self.optimizer.param_groups[0]["lr"]}

    def _optimizer_step(self, forward_backward, context=None, lr=None) -> tuple:
        """Zero the grads, run ``forward_backward()`` (inside ``context``), step the optimizer
        and the LR schedule; with ``lr``, step at that learning rate, the schedule untouched.
        -> (its output, grad norm). A step refused inside ``forward_backward()`` (e.g. a
        ``ReplayInputError`` after some waves ran) discards the partial gradients and re-raises:
        parameters and optimizer stay as they were."""
        self._discard_grads()
        try:
            with context or contextlib.nullcontext():
                out = forward_backward()
        except Exception:
            self._discard_grads()
            raise
        if lr is None:
            self.scheduler.step(increment=0)  # the schedule's rate (after a fixed-lr step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] if lr is None else lr
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("optimizer step skipped: non-finite gradients")
        if lr is None:
            self.scheduler.step(increment=1)
        return out, float(grad_norm or 0.0)

    def _discard_grads(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _forward_backward(self, groups: list, num_loops: int) -> list:
        """The training step of the groups, each by its plan (joint replay or naive)."""
        return self._run_schedule(self.ddp, groups, self.forward_step, num_loops)

    # ---- supervised warm-up and evaluation ------------------------------------------------

    def sft_step(self, step: int) -> dict:
        """Supervised warm-up on gold answers: one padded batch of prompt+answer sequences
        through stock MCore's schedule, per-loop-weighted token-mean NLL of the answers."""
        loops = self.start_step(step)
        seed, count = (step_seed(self.cfg.training.seed, step, self.rank, 3),
                       self.groups_per_rank * self.cfg.rl.grpo_group_size)
        turns = tree_turns(self.cfg.rl)
        episodes = turns > 1 and hasattr(self.task, "supervised_episodes")  # multi-turn
        pairs = (self._episode_pairs(self.task.supervised_episodes(seed, count, turns))
                 if episodes else self.task.supervised_pairs(seed, count))
        batch = self._sft_batch(pairs)
        out, grad_norm = self._optimizer_step(lambda: get_forward_backward_func()(
            forward_step_func=partial(sft_forward_step, self.objective, num_loops=loops),
            data_iterator=iter([batch]), model=self.ddp, num_microbatches=1,
            seq_length=batch["tokens"].shape[1], micro_batch_size=len(pairs)),
            lr=self.cfg.rl.rl_warmup_sft_lr)
        return self._reduce({"loss": float(out[0]["nll"]), "grad_norm": grad_norm,
                             "lr": self.optimizer.param_groups[0]["lr"], "loops": loops})

    def _sft_batch(self, pairs: list) -> dict:
        """(prompt, answer) pairs, each prompt a text or its token list (bos included)."""
        prompts = [p if isinstance(p, list) else self._prompts([p])[0] for p, _ in pairs]
        answers = [self.tok.encode(a) + [self.tok.eos_id] for _, a in pairs]
        return sft_batch(prompts, answers, self.tok.pad_id, self.device)

    def _episode_pairs(self, episodes: list) -> list:
        """(context tokens, final answer) of multi-turn warm-up episodes ``(problem, earlier
        answers)``: the prompt, then each earlier answer with its eos and the environment's
        reply to it."""
        contexts = self._prompts([problem.prompt for problem, _ in episodes])
        pairs = []
        for (problem, earlier), context in zip(episodes, contexts):
            for said in earlier:
                context = (context + self.tok.encode(said) + [self.tok.eos_id]
                           + self.tok.encode(self.task.reply(problem, said)))
            pairs.append((context, problem.answer))
        return pairs

    @torch.no_grad()
    def evaluate(self, num_loops=None) -> dict:
        """Greedy exact-match accuracy on fixed held-out prompts (``eval_problems``), from
        every loop's readout of ``num_loops`` loops (None: the config's). Each data-parallel
        rank decodes its share, ``eval_rows`` prompts at a time (no more K/V than an RL
        rollout); the rewards are summed over the ranks."""
        problems = self.eval_problems()[self.rank :: self.world]
        chunks = [problems[i : i + self.eval_rows]
                  for i in range(0, len(problems), self.eval_rows)]
        R, turns = num_loops or self.model.config.looped_num_loops, tree_turns(self.cfg.rl)
        sums = [sum(float(self.rewards(c, self.rollout(0, c, 1, temperature=0.0, loop=loop,
                                                       num_loops=num_loops)).sum())
                    for c in chunks) for loop in range(R)]
        if turns > 1:  # the whole episode, greedy: one answer per turn, the replies between
            sums.append(sum(float(torch.cat(self.tree_rewards(c, self.tree_rollout(
                0, c, num_loops, branches=[1] * turns, temperature=0.0))).sum())
                for c in chunks))
        *sums, count = self._data_parallel_sum(sums + [len(problems)])
        per_loop = [s / count for s in sums[:R]]
        out = {"eval_reward": per_loop[-1], "eval_per_loop": per_loop}
        if turns > 1:
            out["eval_final_reward"] = sums[R] / count
        return out

    def _data_parallel_sum(self, values: list) -> list:
        """``values`` summed over the data-parallel ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return t.tolist()

    def _reduce(self, metrics: dict) -> dict:
        """Mean of scalar metrics over data-parallel ranks; a per-token loss is the step's
        token mean, its sum over ranks over their token count (``step_token_mean``)."""
        keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
        vals = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64,
                            device=self.device)  # NCCL reduces device tensors only
        if self.world > 1:
            dist.all_reduce(vals, group=parallel_state.get_data_parallel_group())
            vals /= self.world
        out = {**metrics, **dict(zip(keys, vals.tolist()))}
        if "loss_tokens" in out:
            out["loss"] = out.pop("loss_token_sum") / out.pop("loss_tokens")
        return out
