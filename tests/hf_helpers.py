"""Helpers of the pretrained-import tests: random weights everywhere, and Hugging Face RMSNorm
in the input's dtype (HF computes it in fp32 whatever the input, which rounds an fp64
reference to fp32; the same formula in fp64 makes the reference a true fp64 function)."""

import torch


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
