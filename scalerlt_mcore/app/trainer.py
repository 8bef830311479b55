"""The RL loop: rollouts -> verifiable rewards -> group advantages -> joint-replay PPO steps.

Every step's prompts and samples derive from (seed, step, data-parallel rank) alone, so a
resumed run draws the same data as an uninterrupted one, and the ranks of a tensor-parallel
group draw the same data.
"""

import contextlib
import copy
import time
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from ..rl.advantages import group_advantages
from ..rl.objective import RLObjective, loop_weights, rl_forward_step
from ..rl.rollout import generate
from ..rl.tasks import get_task
from ..rl.tokenizer import CharTokenizer
from ..shared_prefix import (
    SavedTensorProbe,
    SharedPrefixGroup,
    get_shared_prefix_forward_backward_func,
    logprobs_forward_step,
    naive_step,
)


def step_seed(seed: int, step: int, rank: int, salt: int = 0) -> int:
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + salt) % (2**31 - 1)


def build_groups(prompts: list, responses, lengths, pad_id: int, step: int) -> list:
    """SharedPrefixGroups (tokens, labels, loss mask) from rollout tensors [N, G, S]."""
    groups = []
    for n, prompt in enumerate(prompts):
        P, S = len(prompt), int(lengths[n].max())
        G = responses.shape[1]
        tokens = torch.full((G, P + S), pad_id, dtype=torch.long)
        tokens[:, :P] = torch.tensor(prompt)
        tokens[:, P:] = responses[n, :, :S]
        labels = torch.full_like(tokens, pad_id)
        labels[:, :-1] = tokens[:, 1:]
        span = torch.arange(P + S)[None, :]
        mask = ((span >= P - 1) & (span < P - 1 + lengths[n][:, None])).float()  # [G, T]
        groups.append(SharedPrefixGroup(tokens=tokens, labels=labels, loss_mask=mask,
                                        prompt_length=P, group_id=step * 100_000 + n))
    return groups


def summarise(out: list, num_groups: int) -> dict:
    """Mean group loss, and clip fraction and k3 KL per response token, from either schedule's
    per-microbatch dicts of sums (joint replay: one per group; naive: one per microbatch)."""
    loss = sum(float(o["loss"]) for o in out) / num_groups
    tokens = sum(float(o["tokens"]) for o in out)
    clip = sum(float(o["clipped"]) for o in out) / tokens
    kl = sum(float(o["kl"]) for o in out) / tokens
    return {"loss": loss, "clip_fraction": clip, "kl": kl}


class RLTrainer:
    """GRPO/PPO over all-loop readouts of a looped GPT on MCore DDP + distributed Adam."""

    def __init__(self, cfg, model, ddp, optimizer, scheduler):
        self.cfg, self.model, self.ddp = cfg, model, ddp
        self.optimizer, self.scheduler = optimizer, scheduler
        # data are drawn per data-parallel rank: identical on the ranks of a TP group
        self.rank = parallel_state.get_data_parallel_rank()
        self.world = parallel_state.get_data_parallel_world_size()
        self.tok = CharTokenizer()
        self.task = get_task(cfg.rl.rl_task, **cfg.rl.rl_task_options)
        rl = cfg.rl
        self.objective = RLObjective(
            normalization=rl.rl_loss_normalization, constant_length=rl.rl_max_response_length,
            clip_low=rl.rl_clip_low, clip_high=rl.rl_clip_high, kl_coef=rl.rl_kl_coef,
            loop_weights=rl.rl_loop_weights,
        )
        self.forward_step = rl_forward_step(self.objective)
        self.schedule = get_shared_prefix_forward_backward_func(
            cfg.shared_prefix.shared_prefix_wave_size,
            cfg.shared_prefix.shared_prefix_checkpoint_waves, rl.rl_max_response_length)
        self.ref = self._frozen_copy(model) if rl.rl_kl_coef > 0 else None
        self.groups_per_rank = cfg.training.global_batch_size // rl.rl_group_size // self.world

    @staticmethod
    def _frozen_copy(model):
        """A frozen copy of the weights. MCore modules hold process groups (which cannot be
        copied) and the config holds the DDP hooks: the copy shares both."""
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
        """Token lists of prompt strings, each led by bos."""
        return [[self.tok.bos_id] + self.tok.encode(t) for t in texts]

    def rollout(self, step: int, problems, group_size: int, temperature: float, loop: int = -1):
        gen = torch.Generator().manual_seed(step_seed(self.cfg.training.seed, step, self.rank, 7))
        self.model.eval()
        out = generate(self.model, self._prompts([p.prompt for p in problems]), group_size,
                       self.cfg.rl.rl_max_response_length, eos_id=self.tok.eos_id,
                       pad_id=self.tok.pad_id, temperature=temperature,
                       top_p=self.cfg.rl.rl_top_p, generator=gen,
                       banned=(self.tok.pad_id, self.tok.bos_id), loop=loop,
                       vocab_size=self.tok.vocab_size)
        self.model.train()
        return out

    def rewards(self, problems, rollout, partial: bool = False) -> torch.Tensor:
        """[N, G] verifiable rewards of the decoded responses (exact match unless ``partial``)."""
        return torch.tensor([
            [self.task.reward(p, self.tok.decode(r.tolist()), partial_credit=partial)
             for r in rollout.responses[n]]
            for n, p in enumerate(problems)
        ], dtype=torch.float64)

    def _run_schedule(self, model, groups: list, forward_step_func,
                      forward_only: bool = False) -> list:
        """The shared-prefix schedule over ``groups``, one group per microbatch."""
        return self.schedule(forward_step_func=forward_step_func, data_iterator=iter(groups),
                             model=model, num_microbatches=len(groups),
                             seq_length=groups[0].tokens.shape[1],
                             micro_batch_size=groups[0].group_size, forward_only=forward_only,
                             collect_non_loss_data=forward_only)

    def score(self, model, groups: list) -> list:
        """forward_only through the shared-prefix schedule: per-loop log-probs [R, G, T]."""
        return self._run_schedule(model, groups, logprobs_forward_step, forward_only=True)

    # ---- one RL step -----------------------------------------------------------------------

    def rl_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        problems = self.task.sample(step_seed(self.cfg.training.seed, step, self.rank),
                                    self.groups_per_rank)
        ro = self.rollout(step, problems, self.cfg.rl.rl_group_size, self.cfg.rl.rl_temperature)
        rewards = self.rewards(problems, ro, self.cfg.rl.rl_partial_credit)
        advantages = group_advantages(rewards, self.cfg.rl.rl_advantage)  # rejects NaN/inf
        groups = build_groups(ro.prompts, ro.responses, ro.lengths, self.tok.pad_id, step)
        drift = self._attach_logprobs(groups, advantages, ro)
        train = self.optimize(groups)
        tokens = float(sum(g.loss_mask.sum() for g in groups))
        return self._reduce({
            "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
            "response_length": ro.lengths.float().mean().item(), **train,
            "rollout_logprob_max_diff": drift, "tokens_per_s": tokens / (time.perf_counter() - t0),
        })

    def _attach_logprobs(self, groups, advantages, ro) -> float:
        """old (and ref) log-probs; returns max |rollout - training forward| log-prob."""
        old = self.score(self.ddp, groups)
        ref = self.score(self.ref, groups) if self.ref is not None else [None] * len(groups)
        drift = 0.0
        for n, g in enumerate(groups):
            g.old_logprobs, g.ref_logprobs = old[n].detach(), ref[n]
            g.advantages = advantages[n]
            P, lens = g.prompt_length, ro.lengths[n]
            for i in range(g.group_size):
                train_lp = g.old_logprobs[-1, i, P - 1 : P - 1 + lens[i]]
                diff = (train_lp.float() - ro.logprobs[n, i, : lens[i]]).abs().max().item()
                drift = max(drift, diff)
        return drift

    def optimize(self, groups: list) -> dict:
        """``rl_ppo_epochs`` optimizer steps on the groups; the last one's stats."""
        for _ in range(self.cfg.rl.rl_ppo_epochs):
            probe = SavedTensorProbe(self.model)
            out, grad_norm = self._optimizer_step(lambda: self._forward_backward(groups), probe)
        return {**summarise(out, len(groups)), "grad_norm": grad_norm,
                "peak_saved_bytes": probe.peak_bytes,
                "lr": self.optimizer.param_groups[0]["lr"]}

    def _optimizer_step(self, forward_backward, context=None) -> tuple:
        """Zero the grads, run ``forward_backward()`` (inside ``context``), step the optimizer
        and the LR schedule. -> (its output, grad norm)."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        with context or contextlib.nullcontext():
            out = forward_backward()
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("optimizer step skipped: non-finite gradients")
        self.scheduler.step(increment=1)
        return out, float(grad_norm or 0.0)

    def _forward_backward(self, groups: list) -> list:
        if self.cfg.shared_prefix.shared_prefix_schedule == "naive":
            return naive_step(self.ddp, groups, self.forward_step,
                              self.cfg.training.micro_batch_size)
        return self._run_schedule(self.ddp, groups, self.forward_step)

    # ---- supervised warm-up and evaluation ------------------------------------------------

    def sft_step(self, step: int) -> dict:
        """Supervised warm-up on gold answers: one padded batch of prompt+answer sequences
        through stock MCore's schedule, per-loop-weighted token-mean NLL of the answers."""
        pairs = self.task.supervised_pairs(step_seed(self.cfg.training.seed, step, self.rank, 3),
                                           self.groups_per_rank * self.cfg.rl.rl_group_size)
        batch = self._sft_batch(pairs)
        out, grad_norm = self._optimizer_step(lambda: get_forward_backward_func()(
            forward_step_func=partial(_sft_forward_step, self.objective.loop_weights),
            data_iterator=iter([batch]), model=self.ddp, num_microbatches=1,
            seq_length=batch["tokens"].shape[1], micro_batch_size=len(pairs)))
        return self._reduce({"loss": float(out[0]["nll"]), "grad_norm": grad_norm,
                             "lr": self.optimizer.param_groups[0]["lr"]})

    def _sft_batch(self, pairs: list) -> dict:
        """tokens/labels [N, T] right-padded; mask on the positions that predict the answer."""
        prompts = self._prompts([p for p, _ in pairs])
        answers = [self.tok.encode(a) + [self.tok.eos_id] for _, a in pairs]
        T = max(len(p) + len(a) for p, a in zip(prompts, answers))
        tokens = torch.full((len(pairs), T), self.tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(pairs), T)
        for i, (p, a) in enumerate(zip(prompts, answers)):
            tokens[i, : len(p) + len(a)] = torch.tensor(p + a)
            mask[i, len(p) - 1 : len(p) - 1 + len(a)] = 1
        labels = torch.full_like(tokens, self.tok.pad_id)
        labels[:, :-1] = tokens[:, 1:]
        device = next(self.model.parameters()).device
        return {"tokens": tokens.to(device), "labels": labels.to(device), "mask": mask.to(device)}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Greedy exact-match accuracy on fixed held-out prompts, from every loop's readout."""
        problems = self.task.sample(step_seed(self.cfg.training.seed, 10**6, 0),
                                    self.cfg.rl.rl_eval_prompts)
        per_loop = []
        for loop in range(self.model.config.looped_num_loops):
            ro = self.rollout(0, problems, 1, temperature=0.0, loop=loop)
            per_loop.append(self.rewards(problems, ro).mean().item())
        return {"eval_reward": per_loop[-1], "eval_per_loop": per_loop}

    def _reduce(self, metrics: dict) -> dict:
        """Mean of scalar metrics over data-parallel ranks."""
        keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
        vals = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(vals, group=parallel_state.get_data_parallel_group())
            vals /= self.world
        return {**metrics, **dict(zip(keys, vals.tolist()))}


def _sft_loss(scheme: str, mask, logprobs):
    """Per-loop-weighted token-mean NLL; logprobs [R, N, T], mask [N, T]."""
    w = loop_weights(scheme, logprobs.shape[0]).to(logprobs.dtype)[:, None, None]
    nll = -(w * logprobs * mask.to(logprobs.dtype)).sum() / mask.sum()
    return nll, {"nll": nll.detach()}


def _sft_forward_step(scheme: str, data_iterator, model):
    batch = next(data_iterator)
    logprobs = model(batch["tokens"], labels=batch["labels"]).logprobs  # [R, N, T]
    return logprobs, partial(_sft_loss, scheme, batch["mask"])
