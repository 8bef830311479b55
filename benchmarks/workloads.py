"""Benchmark workloads: the model configuration and one synthetic GRPO group per workload."""

from dataclasses import asdict, dataclass

import torch

# Megatron-Core is imported inside the functions below, so that the workload definitions
# (and ``--help`` of the entry points) load without it.


@dataclass(frozen=True)
class Workload:
    """One group of G responses of length S after a prompt of length P, and the model."""

    name: str
    group_size: int  # G
    prompt_length: int  # P
    response_length: int  # S
    wave_size: int  # W
    num_loops: int = 4  # R
    core_layers: int = 2  # L_core
    hidden: int = 256
    heads: int = 4
    vocab: int = 64  # small on purpose: the readout must not dominate the layer work
    repetitions: int = 5  # timed repetitions per schedule (after one warm-up)
    full_length: bool = True  # every response exactly S tokens (else random lengths <= S)
    variants: bool = True  # also joint_retain and auto (off in the G x P:S sweep: bench time)

    def describe(self) -> dict:
        return asdict(self)


def build_config(wl: Workload, **overrides):
    """Looped GPT config: no prelude/coda, ``looped_num_loops`` = R, dropout 0."""
    from scalerlt_mcore.model.config import LoopedTransformerConfig

    kwargs = dict(num_layers=wl.core_layers, hidden_size=wl.hidden,
                  num_attention_heads=wl.heads, use_cpu_initialization=True,
                  looped_num_loops=wl.num_loops, looped_prefix_attention="cascade")
    kwargs.update(overrides)
    return LoopedTransformerConfig(**kwargs)


def build_model(wl: Workload, layer_spec=None, **config_overrides):
    """The benchmark model (local layer spec unless one is given), in train mode."""
    from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec

    spec = layer_spec if layer_spec is not None else get_looped_gpt_layer_local_spec()
    config = build_config(wl, **config_overrides)
    max_len = wl.prompt_length + wl.response_length
    model = LoopedGPTModel(config, spec, wl.vocab, max_len)
    return model.train()


def objective():
    """Token-mean PPO over all-loop readouts with progressive loop credit (every loop trains)."""
    from scalerlt_mcore.rl.objective import RLObjective

    return RLObjective(normalization="token_mean", loop_weights="progressive")


def make_group(wl: Workload, seed: int = 0, device=None):
    """A group with random tokens on ``device``; old log-probs are filled in by
    ``attach_old_logprobs``."""
    from scalerlt_mcore.rl.batch import RLGroup

    gen = torch.Generator().manual_seed(seed)
    G, P, S, V = wl.group_size, wl.prompt_length, wl.response_length, wl.vocab
    prompt = torch.randint(1, V, (P,), generator=gen)
    if wl.full_length:
        lens = torch.full((G,), S)
    else:
        lens = torch.randint(1, S + 1, (G,), generator=gen)
        lens[0] = S
    responses = torch.zeros(G, S, dtype=torch.long)  # [G, S], right-padded with 0
    for i, n in enumerate(lens.tolist()):
        responses[i, :n] = torch.randint(1, V, (n,), generator=gen)
    advantages = torch.randn(G, generator=gen)
    old = torch.zeros(wl.num_loops, G, P + S)  # [R, G, T], placeholder
    return RLGroup.from_rollout(prompt, responses, lens, 0, device=device,
                                advantages=advantages, old_logprobs=old)


@torch.no_grad()
def attach_old_logprobs(model, group, seed: int = 0, noise: float = 0.05):
    """Behaviour log-probs near the current policy's (ratios near 1, few clipped tokens), so
    that every token contributes gradient: a plain forward of every full sequence + noise."""
    lp = model(group.tokens, labels=group.labels).logprobs.float()  # [R, G, T]
    gen = torch.Generator().manual_seed(seed + 1)
    lp = lp + noise * torch.randn(lp.shape, generator=gen).to(lp.device)
    group.old_logprobs = lp * (group.loss_mask > 0)
    return group
