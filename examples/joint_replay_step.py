"""One shared-prefix training step, wired by hand: a looped GPT in MCore DDP with the
distributed Adam, driven by the joint-replay schedule where MCore's schedule would be.

    python examples/joint_replay_step.py            (CPU, one process)
"""

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.config import LoopedTransformerConfig
from scalerlt_mcore.rl import RLObjective, rl_forward_step
from scalerlt_mcore.rl.batch import RLGroup
from scalerlt_mcore.shared_prefix import (
    get_shared_prefix_forward_backward_func,
    logprobs_forward_step,
)
from scalerlt_mcore.testing import model_parallel_context

VOCAB, PROMPT, RESPONSE, G = 64, 24, 6, 8


def group(gen) -> RLGroup:
    """One prompt, G random responses of uneven length (right-padded with 0)."""
    prompt = torch.randint(1, VOCAB, (PROMPT,), generator=gen)
    lengths = torch.randint(1, RESPONSE + 1, (G,), generator=gen)
    responses = torch.zeros(G, RESPONSE, dtype=torch.long)  # [G, S]
    for i, n in enumerate(lengths.tolist()):
        responses[i, :n] = torch.randint(1, VOCAB, (n,), generator=gen)
    # tokens = prompt + response, labels = tokens shifted by one, loss mask on the positions
    # that predict a response token; all on the model's device (here the CPU)
    return RLGroup.from_rollout(prompt, responses, lengths, pad_id=0,
                                advantages=torch.randn(G, generator=gen))


def main() -> None:
    with model_parallel_context(seed=0):
        config = LoopedTransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
            looped_num_loops=3, looped_num_prelude_layers=1, looped_injection="linear_concat")
        model = LoopedGPTModel(config, get_looped_gpt_layer_local_spec(), VOCAB, 64)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp])
        # The schedule reaches DDP only through these two, as MCore's no-pipelining schedule
        # does (grad_sync_func, a hook of MCore's pipeline schedules, is not read).
        config.no_sync_func = ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads

        forward_backward = get_shared_prefix_forward_backward_func(wave_size=3)
        rl_step = rl_forward_step(RLObjective(loop_weights="progressive"))
        groups = [group(torch.Generator().manual_seed(s)) for s in range(2)]
        scores = forward_backward(forward_step_func=logprobs_forward_step,
                                  data_iterator=iter(groups), model=ddp, num_microbatches=2,
                                  seq_length=PROMPT + RESPONSE, micro_batch_size=G,
                                  forward_only=True, collect_non_loss_data=True)
        for g, logprobs in zip(groups, scores):
            g.old_logprobs = logprobs  # per-loop behaviour log-probs [R, G, T]
        ddp.zero_grad_buffer()
        results = forward_backward(forward_step_func=rl_step, data_iterator=iter(groups),
                                   model=ddp, num_microbatches=2,
                                   seq_length=PROMPT + RESPONSE, micro_batch_size=G)
        ok, grad_norm, _ = optimizer.step()
        for r in results:
            print(f"group loss {float(r['loss']):+.5f} in {int(r['num_waves'])} waves")
        print(f"optimizer step ok={ok}, grad norm {grad_norm:.4f}")


if __name__ == "__main__":
    main()
