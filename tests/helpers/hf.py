"""Helpers of the pretrained-import tests: random weights everywhere, and Hugging Face RMSNorm
in the input's dtype (HF computes it in fp32 whatever the input, which rounds an fp64
reference to fp32; the same formula in fp64 makes the reference a true fp64 function); the
tiny Llama and Qwen2 builders (``BUILDERS``) and their saved directories
(``write_hf_dirs``)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def randomize(model, seed: int) -> None:
    """Every parameter random (norms around 1, biases non-zero) so no term is trivially equal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)


def rms_norm_in_input_dtype(self, x):
    """``LlamaRMSNorm.forward`` / ``Qwen2RMSNorm.forward`` without the cast to fp32."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def patch_hf_rms_norm(monkeypatch) -> None:
    """Run HF's Llama / Qwen2 RMSNorm in the input's dtype for this test."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm_in_input_dtype)


VOCAB, LAYERS = 64, 4
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2)


def _llama():
    """GQA, untied, llama3 RoPE scaling with a base whose 16-wide heads have frequencies in
    all three bands of the scaling (kept, smoothed, divided by the factor)."""
    return LlamaForCausalLM(LlamaConfig(**SHAPES, rope_theta=500000.0, rope_scaling=LLAMA3,
                                        max_position_embeddings=16384, rms_norm_eps=1e-5,
                                        tie_word_embeddings=False, attn_implementation="sdpa"))


def _qwen2():
    """GQA, tied embeddings, QKV biases, rope_theta 1e6."""
    return Qwen2ForCausalLM(Qwen2Config(**SHAPES, rope_theta=1e6, tie_word_embeddings=True,
                                        attn_implementation="sdpa"))


BUILDERS = {"llama": _llama, "qwen2": _qwen2}


def write_hf_dirs(tmp_path_factory) -> dict:
    """name -> directory of each ``BUILDERS`` model, random (``randomize``), saved by
    transformers: one per name, the same weights for every caller."""
    out = {}
    for k, (name, build) in enumerate(BUILDERS.items()):
        torch.manual_seed(k)
        model = build()
        randomize(model, seed=10 + k)
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name])
    return out
