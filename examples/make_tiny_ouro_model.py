"""Write a tiny random Ouro (LoopLM) checkpoint in its own format (config.json with Ouro's
fields, model.safetensors with its weight names), for trying ``--pretrained-checkpoint`` with a
looped model on CPU without a download.

    python examples/make_tiny_ouro_model.py /tmp/tiny-ouro     (2 layers, total_ut_steps 3)

The weights are the looped GPT's random init (``looped_family`` ouro, exit gate on), with the
exit gate's bias set so the exit distribution is spread over the loops, written by the
project's exporter (``scalerlt_mcore.model.hf_export.save_hf``).
"""

import argparse

import torch
import torch.nn.functional as F

from scalerlt_mcore.model import LoopedGPTModel, LoopedTransformerConfig
from scalerlt_mcore.model.hf_export import save_hf
from scalerlt_mcore.model.specs import get_looped_gpt_block_spec
from scalerlt_mcore.testing import model_parallel_context


def tiny_ouro(layers: int, loops: int, seed: int) -> LoopedGPTModel:
    """A random Ouro-layout looped GPT: hidden 64, 4 heads in 2 K/V groups, vocabulary 64 (the
    trainer's character tokenizer uses the first 49 ids), untied, RoPE base 10000."""
    torch.manual_seed(seed)
    cfg = LoopedTransformerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        looped_num_loops=loops, looped_family="ouro", looped_exit_gate=True,
        use_cpu_initialization=True, init_method_std=0.1)
    model = LoopedGPTModel(cfg, get_looped_gpt_block_spec(cfg), vocab_size=64,
                           max_sequence_length=64, position_embedding_type="rope")
    with torch.no_grad():
        model.decoder.exit_gate.linear.bias.fill_(-1.0)  # lambda about 0.27: mass on every loop
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--loops", type=int, default=3, help="total_ut_steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with model_parallel_context(seed=args.seed):
        save_hf(tiny_ouro(args.layers, args.loops, args.seed), args.out, exit_threshold=0.9)
    print(f"wrote a {args.layers}-layer Ouro (total_ut_steps {args.loops}) to {args.out}")


if __name__ == "__main__":
    main()
