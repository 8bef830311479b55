"""Tokenizers behind one small interface: Megatron-Core's (``megatron.core.tokenizers``) and a
character tokenizer for the built-in toy tasks.

``build_tokenizer(tokenizer_type, tokenizer_model)`` takes Megatron-LM's ``--tokenizer-type``
and ``--tokenizer-model``:

- ``HuggingFaceTokenizer``: a Hugging Face ``tokenizer.json`` (the file, or the folder holding
  it), through MCore's ``huggingface`` library (``transformers``).
- ``ByteLevelTokenizer``: UTF-8 bytes through MCore's ``byte-level`` library; needs no file.
- ``CharTokenizer``: one token per character of ``ALPHABET``, the project's built-in.

Every tokenizer answers ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``, ``encode(text)``
(ids, no specials), ``decode(ids)`` (text up to the first eos, pad and bos dropped) and
``identity()`` (what a checkpoint records to refuse another tokenizer).
"""

import hashlib
import string
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, Optional, Protocol

ALPHABET = string.digits + string.ascii_lowercase + "+-*=%, :>|"
"""Every character the built-in tasks use. Ids follow the special tokens, in this order."""

SPECIALS = ("<pad>", "<bos>", "<eos>")
"""Special tokens of the character tokenizer; their ids are their positions (pad is 0)."""

TokenizerType = Literal["CharTokenizer", "ByteLevelTokenizer", "HuggingFaceTokenizer"]
"""Accepted ``--tokenizer-type`` values (Megatron-LM's names where Megatron-LM has one)."""

TOKENIZER_TYPES: tuple = TokenizerType.__args__


class Tokenizer(Protocol):
    """What rollouts, rewards and training read from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def identity(self) -> dict: ...


def _until_eos(ids: Iterable[int], eos_id: int, drop: tuple) -> list[int]:
    """``ids`` up to (not including) the first eos, without the ids in ``drop``."""
    out = []
    for i in (int(i) for i in ids):
        if i == eos_id:
            break
        if i not in drop:
            out.append(i)
    return out


class CharTokenizer:
    """One token per character of ``ALPHABET`` plus pad (id 0), bos (1) and eos (2).

    ``encode`` rejects characters outside the alphabet; ``decode`` stops at the first eos
    and drops pad and bos, so a sampled response decodes to exactly the text it answered.
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("tokenizer alphabet has repeated characters")
        self.alphabet = alphabet
        self._ids = {ch: i + len(SPECIALS) for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        """Number of ids: special tokens + alphabet."""
        return len(SPECIALS) + len(self.alphabet)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text``, optionally framed by bos / eos. Unknown characters: ValueError."""
        ids = [self._id(ch) for ch in text]
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to the first eos; pad and bos are dropped."""
        kept = _until_eos(ids, self.eos_id, (self.pad_id, self.bos_id))
        return "".join(self._char(i) for i in kept)

    def identity(self) -> dict:
        return {"type": "CharTokenizer", "vocab_size": self.vocab_size,
                "sha256": _sha256(self.alphabet.encode())}

    def _id(self, ch: str) -> int:
        if ch not in self._ids:
            raise ValueError(f"character {ch!r} is not in the tokenizer alphabet "
                             f"{self.alphabet!r} (use --tokenizer-type ByteLevelTokenizer or "
                             "HuggingFaceTokenizer for other text)")
        return self._ids[ch]

    def _char(self, i: int) -> str:
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is out of range [0, {self.vocab_size})")
        return self.alphabet[i - len(SPECIALS)]


class MCoreTokenizer:
    """A ``megatron.core.tokenizers`` tokenizer with this project's interface.

    ``encode`` is MCore's ``tokenize`` (no special tokens added); ``decode`` cuts at the first
    eos, drops pad and bos, then calls MCore's ``detokenize``."""

    def __init__(self, mcore, kind: str, pad_id: int, bos_id: int, eos_id: int,
                 vocab_size: int, model_sha256: str = ""):
        if len({pad_id, bos_id, eos_id}) != 3:
            raise ValueError(f"{kind}: pad, bos and eos need distinct ids, got "
                             f"{pad_id}, {bos_id}, {eos_id}")
        self.mcore, self.kind, self.vocab_size = mcore, kind, vocab_size
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self._sha = model_sha256

    def encode(self, text: str) -> list[int]:
        return list(self.mcore.tokenize(text))

    def decode(self, ids: Iterable[int]) -> str:
        kept = _until_eos(ids, self.eos_id, (self.pad_id, self.bos_id))
        return self.mcore.detokenize(kept) if kept else ""

    def identity(self) -> dict:
        return {"type": self.kind, "vocab_size": self.vocab_size, "sha256": self._sha}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


BYTE_EOS, BYTE_PAD, BYTE_BOS = 256, 257, 258
"""Special ids of the byte-level tokenizer, after the 256 byte values."""


def byte_level_tokenizer() -> MCoreTokenizer:
    """UTF-8 bytes (ids 0-255) plus eos, pad and bos: MCore's ``byte-level`` library."""
    from megatron.core.tokenizers import MegatronTokenizer

    mcore = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "byte-level"}, vocab_size=259,
        _eos_id=BYTE_EOS, _pad_id=BYTE_PAD, _bos_id=BYTE_BOS)
    return MCoreTokenizer(mcore, "ByteLevelTokenizer", BYTE_PAD, BYTE_BOS, BYTE_EOS, 259,
                          _sha256(b"utf-8 bytes"))


_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
_BOS_NAMES = ("<bos>", "<s>", "<|startoftext|>", "[CLS]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")


def _tokenizer_file(model: str) -> Path:
    """The ``tokenizer.json`` of ``--tokenizer-model`` (the file or its folder)."""
    path = Path(model)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"tokenizer_model {model!r}: no Hugging Face tokenizer.json there")
    if file.name != "tokenizer.json":  # MCore's library loads the folder's tokenizer.json
        raise ValueError(f"tokenizer_model {model!r}: the file must be named tokenizer.json")
    return file


def _named(vocab: dict, names: tuple) -> Optional[str]:
    """The first of ``names`` in ``vocab``, or None."""
    return next((n for n in names if n in vocab), None)


def huggingface_tokenizer(model: str) -> MCoreTokenizer:
    """A Hugging Face ``tokenizer.json`` through MCore's ``huggingface`` library. eos: a token
    named like one (``<eos>``, ``</s>``, ``<|endoftext|>``, ...), required; bos and pad: one
    named like them, else MCore appends ``<bos>`` / ``<pad>`` to the vocabulary."""
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        import transformers  # noqa: F401  (MCore's huggingface library needs it)
        from tokenizers import Tokenizer as RawTokenizer
    except ImportError as e:
        raise ValueError("tokenizer_type HuggingFaceTokenizer needs the transformers and "
                         "tokenizers packages (pip install 'scalerlt_mcore[rl]')") from e
    file = _tokenizer_file(model)
    vocab = RawTokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    eos = _named(vocab, _EOS_NAMES)
    if eos is None:
        raise ValueError(f"tokenizer_model {model!r} has no end-of-sequence token (one of "
                         f"{', '.join(_EOS_NAMES)})")
    bos, pad = _named(vocab, _BOS_NAMES) or "<bos>", _named(vocab, _PAD_NAMES) or "<pad>"
    mcore = MegatronTokenizer.from_pretrained(
        tokenizer_path=str(file.parent), metadata_path={"library": "huggingface"},
        use_fast=True, eos_token=eos, bos_token=bos, pad_token=pad)
    hf = mcore._tokenizer.tokenizer
    pad_id, bos_id, eos_id = (hf.convert_tokens_to_ids(t) for t in (pad, bos, eos))
    return MCoreTokenizer(mcore, "HuggingFaceTokenizer", pad_id, bos_id, eos_id, len(hf),
                          _sha256(file.read_bytes()))


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None) -> Tokenizer:
    """The tokenizer of Megatron-LM's ``--tokenizer-type`` / ``--tokenizer-model``."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"tokenizer_type must be one of {TOKENIZER_TYPES}, "
                         f"got {tokenizer_type!r}")
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("tokenizer_type HuggingFaceTokenizer needs tokenizer_model "
                             "(a tokenizer.json file or its folder)")
        return huggingface_tokenizer(tokenizer_model)
    if tokenizer_model:
        raise ValueError(f"tokenizer_type {tokenizer_type} takes no tokenizer_model, got "
                         f"{tokenizer_model!r}")
    return byte_level_tokenizer() if tokenizer_type == "ByteLevelTokenizer" else CharTokenizer()
