"""``scalerlt_mcore.rl.tokenizer``: MCore's byte-level and Hugging Face tokenizers behind the
project's interface, checked against independent references (Python's UTF-8 codec, the
``tokenizers`` package reading the same tokenizer.json)."""

import pytest
from helpers.tokenizer_files import train_bpe
from tokenizers import Tokenizer as RawTokenizer

from scalerlt_mcore.rl.tokenizer import (
    CharTokenizer,
    MCoreTokenizer,
    build_tokenizer,
)

TEXTS = ["Calculate 5 - 3 - 6.", "Spell this word backward (example: sun -> nus): hello",
         "abc>cba", "12+3=", "héllo wörld ∫"]


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_byte_level_is_utf8_bytes_with_specials_after_them():
    tok = build_tokenizer("ByteLevelTokenizer")
    assert isinstance(tok, MCoreTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id) == (259, 256, 257, 258)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode([tok.bos_id] + ids + [tok.eos_id] + tok.encode("tail")) == text
    assert tok.decode([tok.pad_id, tok.eos_id]) == ""


def test_huggingface_tokenizer_json_matches_the_tokenizers_package(bpe_file):
    tok = build_tokenizer("HuggingFaceTokenizer", str(bpe_file))
    raw = RawTokenizer.from_file(str(bpe_file))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == tuple(
        raw.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>"))
    assert tok.vocab_size == raw.get_vocab_size() == 320
    merged = 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids  # no special tokens added
        merged += len(ids) < len(text.encode())
        assert tok.decode(ids + [tok.eos_id, ids[0]]) == text
        assert tok.decode([tok.bos_id] + ids + [tok.pad_id]) == text
    assert merged >= 3, "BPE merges: fewer tokens than bytes"
    # the folder holding tokenizer.json is accepted too, the same tokenizer
    same = build_tokenizer("HuggingFaceTokenizer", str(bpe_file.parent))
    assert same.identity() == tok.identity()


@pytest.mark.parametrize("eos", ["</s>", "<|end_of_text|>"])  # Llama 2, Llama 3
def test_missing_pad_and_bos_are_appended_by_mcore(tmp_path, eos):
    path = train_bpe(tmp_path / "tokenizer.json", specials=(eos,))
    raw = RawTokenizer.from_file(str(path))
    tok = build_tokenizer("HuggingFaceTokenizer", str(path))
    assert tok.eos_id == raw.token_to_id(eos)
    assert sorted((tok.bos_id, tok.pad_id)) == [raw.get_vocab_size(), raw.get_vocab_size() + 1]
    assert tok.vocab_size == raw.get_vocab_size() + 2
    assert tok.decode(tok.encode("abc") + [tok.eos_id]) == "abc"


def test_identity_names_type_vocab_and_file_content(tmp_path, bpe_file):
    other = train_bpe(tmp_path / "tokenizer.json", vocab_size=300)
    a = build_tokenizer("HuggingFaceTokenizer", str(bpe_file)).identity()
    b = build_tokenizer("HuggingFaceTokenizer", str(other)).identity()
    assert a["type"] == b["type"] == "HuggingFaceTokenizer"
    assert (a["vocab_size"], b["vocab_size"]) == (320, 300) and a["sha256"] != b["sha256"]
    assert build_tokenizer("CharTokenizer").identity() == CharTokenizer().identity()
    assert build_tokenizer("ByteLevelTokenizer").identity()["type"] == "ByteLevelTokenizer"


@pytest.mark.parametrize("kind, model, message", [
    ("GPT2BPETokenizer", None, "tokenizer_type must be one of"),
    ("HuggingFaceTokenizer", None, "needs tokenizer_model"),
    ("HuggingFaceTokenizer", "/nonexistent/tokenizer.json", "no Hugging Face tokenizer.json"),
    ("ByteLevelTokenizer", "x.json", "takes no tokenizer_model"),
    ("CharTokenizer", "x.json", "takes no tokenizer_model"),
])
def test_bad_tokenizer_flags_are_named(kind, model, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(kind, model)


def test_tokenizer_file_with_another_name_is_refused(tmp_path, bpe_file):
    other = tmp_path / "vocab.json"
    other.write_bytes(bpe_file.read_bytes())
    with pytest.raises(ValueError, match="must be named tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(other))


def test_tokenizer_json_without_eos_is_refused(tmp_path):
    path = train_bpe(tmp_path / "tokenizer.json", specials=("<pad>",))
    with pytest.raises(ValueError, match="has no end-of-sequence token"):
        build_tokenizer("HuggingFaceTokenizer", str(path))


def test_char_tokenizer_error_points_to_the_other_tokenizers():
    with pytest.raises(ValueError, match="'C'.*--tokenizer-type ByteLevelTokenizer"):
        CharTokenizer().encode("Calculate")
