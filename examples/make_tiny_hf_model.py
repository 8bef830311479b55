"""Write a tiny random Hugging Face model (config.json + model.safetensors + tokenizer.json) to
start from, for trying ``--pretrained-checkpoint`` and ``--tokenizer-type HuggingFaceTokenizer``
on CPU without a download (needs ``transformers`` and ``tokenizers``).

The tokenizer.json is character level over the built-in tasks' characters (<pad> <bos> <eos>,
then the same characters in the same order as the trainer's CharTokenizer: ids 0-48 of the
model's 64).

    python examples/make_tiny_hf_model.py /tmp/tiny-llama            (8-layer Llama)
    python examples/make_tiny_hf_model.py /tmp/tiny-qwen2 --arch qwen2
"""

import argparse
from pathlib import Path

import torch

from scalerlt_mcore.rl.tokenizer import ALPHABET, SPECIALS


def tiny_model(arch: str, layers: int, seed: int):
    """A random ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``: hidden 64, 4 heads in 2 K/V groups,
    vocabulary 64 (the trainer's character tokenizer uses the first 49 ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shapes = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**shapes, rope_theta=10000.0))
    return Qwen2ForCausalLM(Qwen2Config(**shapes, tie_word_embeddings=True))


def write_tokenizer(out: Path) -> Path:
    """A character-level Hugging Face tokenizer.json (one token per character, decoded by
    concatenation) in ``out``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate((*SPECIALS, *ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    path = Path(out) / "tokenizer.json"
    tok.save(str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write")
    parser.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tiny_model(args.arch, args.layers, args.seed).save_pretrained(args.out)
    write_tokenizer(args.out)
    print(f"wrote a {args.layers}-layer {args.arch} model and its tokenizer.json to {args.out}")


if __name__ == "__main__":
    main()
