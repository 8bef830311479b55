"""The decode tests' model: a tiny looped GPT (prelude, core, coda) in fp64 with its weights
in the plain-PyTorch reference's form."""

import torch

from helpers.reference_looped import RefConfig, weights_from_state_dict
from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.config import LoopedTransformerConfig

VOCAB, LOOPS, N_PRE, N_CORE, N_CODA = 64, 3, 1, 2, 1


def build(pe: str, dtype=torch.float64) -> tuple:
    """R=3 with prelude, coda and injection, random weights; plus its reference weights."""
    cfg = LoopedTransformerConfig(
        num_layers=N_CORE, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, looped_num_loops=LOOPS, looped_num_prelude_layers=N_PRE,
        looped_num_coda_layers=N_CODA, looped_injection="linear_concat",
    )
    model = LoopedGPTModel(cfg, get_looped_gpt_layer_local_spec(), VOCAB, 32,
                           position_embedding_type=pe).to(dtype)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype)
            p.copy_(1 + 0.1 * noise if "layernorm.weight" in name else 0.2 * noise)
    ref = RefConfig(hidden=32, heads=4, groups=2, n_core=N_CORE, n_prelude=N_PRE,
                    n_coda=N_CODA, loops=LOOPS, injection="linear_concat", position=pe)
    return model, ref, weights_from_state_dict(model.state_dict(), ref)


# prompts, an environment and the segment checks of the tree-decoding tests
PROMPTS = [[7, 3, 9], [4, 12, 30, 2, 8], [11]]
EOS, PAD = VOCAB + 1, 0  # an eos the model never draws: every answer runs its budget


def reply(prompt: int, path: list, answer: list) -> list:
    """A deterministic environment: 1 to 3 tokens (ids 3 ... 39) depending on the prompt's
    index, the path and the answer."""
    return [(len(path) + a + 5 * prompt) % 37 + 3 for a in answer[: 1 + len(path) % 3]]


def check_segments(rollout, n: int, reply_fn=None) -> None:
    """Root first with a zero mask; every child starts at its parent's end; answers trained,
    replies not; every row's path."""
    segs = rollout.segments[n]
    assert segs[0].parent is None and segs[0].tokens == PROMPTS[n] and not any(segs[0].loss_mask)
    for i, s in enumerate(segs[1:], 1):
        up = segs[s.parent]
        assert s.parent < i and s.start == up.start + len(up.tokens)
        assert len(s.loss_mask) == len(s.tokens) >= 1
        trained = sum(s.loss_mask)
        assert s.loss_mask == [1] * trained + [0] * (len(s.tokens) - trained)
        if reply_fn is not None and i not in rollout.leaves[n]:
            path = [t for j in rollout.path(n, s.parent) for t in segs[j].tokens]
            answer = s.tokens[:trained]
            assert s.tokens[trained:] == reply_fn(n, path, answer)
