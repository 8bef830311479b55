"""The tokenizer section (Megatron-LM's flags; ``scalerlt_mcore.rl.tokenizer``) and its check."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ...rl.tokenizer import TokenizerType
from .builders import tokenizer_from

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass
class TokenizerArgs:
    """The tokenizer (Megatron-LM's flags; ``scalerlt_mcore.rl.tokenizer``)."""

    tokenizer_type: Optional[TokenizerType] = None
    """``CharTokenizer`` (the built-in tasks' characters), ``ByteLevelTokenizer`` (UTF-8
    bytes, MCore's byte-level tokenizer) or ``HuggingFaceTokenizer`` (a tokenizer.json); None:
    ``HuggingFaceTokenizer`` when ``pretrained_checkpoint`` is a Hugging Face directory holding
    a tokenizer.json, else ``CharTokenizer``."""
    tokenizer_model: Optional[str] = None
    """The ``HuggingFaceTokenizer``'s tokenizer.json file, or the folder holding it; None: the
    tokenizer.json of a Hugging Face ``pretrained_checkpoint``."""


def check_tokenizer(cfg: "RunConfig") -> list[str]:
    """The tokenizer builds (``tokenizer_from``: the flags, or a pretrained checkpoint's)."""
    try:
        tokenizer_from(cfg)
    except (ValueError, OSError) as e:
        return [f"tokenizer_type / tokenizer_model: {e}"]
    return []
