"""A character tokenizer over a fixed alphabet, enough for the built-in tasks."""

import string
from collections.abc import Iterable

ALPHABET = string.digits + string.ascii_lowercase + "+-*=%, :>|"
"""Every character the tasks use. Ids follow the special tokens, in this order."""

SPECIALS = ("<pad>", "<bos>", "<eos>")
"""Special tokens; their ids are their positions (pad is 0)."""


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
        chars = []
        for i in (int(i) for i in ids):
            if i == self.eos_id:
                break
            if i not in (self.pad_id, self.bos_id):
                chars.append(self._char(i))
        return "".join(chars)

    def _id(self, ch: str) -> int:
        if ch not in self._ids:
            raise ValueError(f"character {ch!r} is not in the tokenizer alphabet {self.alphabet!r}")
        return self._ids[ch]

    def _char(self, i: int) -> str:
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is out of range [0, {self.vocab_size})")
        return self.alphabet[i - len(SPECIALS)]
