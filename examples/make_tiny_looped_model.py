"""Write a tiny random looped checkpoint in its own format (config.json with the model's real
fields, model.safetensors with its weight names), for trying ``--pretrained-checkpoint`` with a
looped model on CPU without a download.

    python examples/make_tiny_looped_model.py /tmp/tiny-ouro                  (Ouro: 2 layers,
                                                                             total_ut_steps 3)
    python examples/make_tiny_looped_model.py /tmp/tiny-huginn --format huginn (prelude 1, core
                                                                             2, coda 1, R 3)
    python examples/make_tiny_looped_model.py /tmp/tiny-nanbeige --format nanbeige --loops 2

The weights are the looped GPT's random init (``looped_family`` ouro with the exit gate, its bias
set so the exit distribution is spread over the loops; ``huginn``; or ``nanbeige``), written by
the project's exporter (``scalerlt_mcore.model.hf_export.save_hf``).
"""

import argparse

import torch
import torch.nn.functional as F

from scalerlt_mcore.model import LoopedGPTModel, LoopedTransformerConfig
from scalerlt_mcore.model.hf_export import save_hf
from scalerlt_mcore.model.specs import get_looped_gpt_block_spec
from scalerlt_mcore.testing import model_parallel_context

FAMILIES = {
    "ouro": dict(looped_family="ouro", looped_exit_gate=True, num_query_groups=2),
    "huginn": dict(looped_family="huginn", looped_num_prelude_layers=1, looped_num_coda_layers=1,
                   looped_injection="linear_concat", looped_initial_state="random",
                   num_query_groups=4),
    "nanbeige": dict(looped_family="nanbeige", num_query_groups=2),
}
"""--format -> the loop layout (Huginn: one K/V head per query head, for its qk bias)."""


def tiny_looped(kind: str, layers: int, loops: int, seed: int) -> LoopedGPTModel:
    """A random looped GPT in ``kind``'s layout: hidden 64, 4 heads, vocabulary 64 (the
    trainer's character tokenizer uses the first 49 ids), untied, RoPE base 10000."""
    torch.manual_seed(seed)
    cfg = LoopedTransformerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, looped_num_loops=loops,
        use_cpu_initialization=True, init_method_std=0.1, **FAMILIES[kind])
    model = LoopedGPTModel(cfg, get_looped_gpt_block_spec(cfg), vocab_size=64,
                           max_sequence_length=64, position_embedding_type="rope",
                           rotary_base=10000)
    with torch.no_grad():
        if kind == "ouro":
            model.decoder.exit_gate.linear.bias.fill_(-1.0)  # lambda ~0.27: mass on every loop
        elif kind == "huginn":
            model.decoder.injection.weight.add_(0.1 * torch.randn_like(
                model.decoder.injection.weight))  # off [I | 0]: the prelude output counts
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write")
    parser.add_argument("--format", choices=tuple(FAMILIES), default="ouro")
    parser.add_argument("--layers", type=int, default=2, help="(core) layers")
    parser.add_argument("--loops", type=int, default=3,
                        help="total_ut_steps / mean_recurrence / num_loops")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with model_parallel_context(seed=args.seed):
        model = tiny_looped(args.format, args.layers, args.loops, args.seed)
        save_hf(model, args.out, exit_threshold=0.9 if args.format == "ouro" else None)
    print(f"wrote a tiny {args.format} model ({args.layers} core layers, R {args.loops}) to "
          f"{args.out}")


if __name__ == "__main__":
    main()
