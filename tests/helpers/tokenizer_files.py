"""Small Hugging Face tokenizer.json files trained here with the ``tokenizers`` package (no
downloads): byte-level BPE on text from the built-in tasks and reasoning-gym-like prompts."""

import random
from pathlib import Path

CORPUS_WORDS = ["abc", "cba", "hello", "world", "reverse", "sort", "calculate", "state", "the",
                "final", "answer", "to", "following", "arithmetic", "problem", "spell", "this",
                "word", "backward", "example", "sun", "nus"]


def corpus(seed: int = 0, n: int = 400) -> list[str]:
    """Sentences of task-like words, digits and operators."""
    rng = random.Random(seed)
    pieces = CORPUS_WORDS + [str(i) for i in range(20)] + list("+-*=%>|:,.()")
    return [" ".join(rng.choice(pieces) for _ in range(12)) for _ in range(n)]


def train_bpe(path: Path, vocab_size: int = 320, specials=("<pad>", "<bos>", "<eos>"),
              seed: int = 0) -> Path:
    """Train a byte-level BPE tokenizer and write it to ``path`` (a tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def train_char_bpe(path: Path, texts: list[str], vocab_size: int,
                   specials=("<pad>", "<bos>", "<eos>")) -> Path:
    """Train a BPE tokenizer.json on ``texts`` from their characters alone (no byte alphabet, so
    the vocabulary can be as small as a tiny model's), decoding by concatenation."""
    from tokenizers import Tokenizer, decoders, models, trainers

    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
