"""The sparrow-tiny tokenizer recipe: reproducible, exact vocabulary, loadable by transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparrow.tiny.tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    EOS_TOKEN,
    IM_END,
    IM_START,
    MIN_VOCAB_SIZE,
    RESERVED_TOKEN_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
    load_tokenizer,
)

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Larger than what training on the corpus yields, so reserved tokens fill the rest.
RESERVED_VOCAB_SIZE = 12_000

SAMPLES = [
    "Hello, world!",
    "  leading spaces, trailing spaces  \n\n\ttabs\tand\nnewlines\n",
    "Crème brûlée for Zoë in Łódź — «très bien» … 100 °C",
    "早上七点，城市慢慢醒来。日本語のテキスト。서울의 아침은 바쁩니다.",
    "Emoji: 🐦🎉👍🏽 and a family 👨‍👩‍👧 and flags 🇵🇹",
    "Characters the corpus never saw: Ω 𝄞 ∮ ꙮ \u200b",
    'def f(x):\n    return {"a": [1, 2, 3]}\n',
]


@pytest.fixture(scope="session")
def recipe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recipe_tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def recipe_tokenizer(recipe_tokenizer_dir: Path):
    return load_tokenizer(recipe_tokenizer_dir)


@pytest.fixture(scope="session")
def reserved_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reserved_tokenizer")
    build_tokenizer(path, vocab_size=RESERVED_VOCAB_SIZE)
    return path


def test_build_writes_the_same_bytes_in_another_process(recipe_tokenizer_dir: Path, tmp_path: Path) -> None:
    # A second interpreter gets fresh hash seeds (Python's and the Rust trainer's).
    other = tmp_path / "again"
    code = f"from sparrow.tiny.tokenizer import build_tokenizer; build_tokenizer({str(other)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    for name in FILES:
        assert (other / name).read_bytes() == (recipe_tokenizer_dir / name).read_bytes(), name


def test_vocabulary_has_exactly_vocab_size_ids(recipe_tokenizer, reserved_tokenizer_dir: Path) -> None:
    assert len(recipe_tokenizer) == 4096
    assert sorted(recipe_tokenizer.get_vocab().values()) == list(range(4096))

    reserved = load_tokenizer(reserved_tokenizer_dir)
    assert len(reserved) == RESERVED_VOCAB_SIZE
    assert sorted(reserved.get_vocab().values()) == list(range(RESERVED_VOCAB_SIZE))
    # Training stopped short of 12,000, so the last id is a reserved filler.
    last = reserved.convert_ids_to_tokens(RESERVED_VOCAB_SIZE - 1)
    assert last.startswith(RESERVED_TOKEN_TEMPLATE.split("{")[0])


@pytest.mark.parametrize("vocab_size", [0, MIN_VOCAB_SIZE - 1, "4096"])
def test_too_small_or_wrong_vocab_size_is_rejected(vocab_size, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size=vocab_size)


def test_smallest_vocabulary_still_encodes_everything(tmp_path: Path) -> None:
    build_tokenizer(tmp_path, vocab_size=MIN_VOCAB_SIZE)
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer) == MIN_VOCAB_SIZE
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_files_are_a_standard_hugging_face_directory(recipe_tokenizer_dir: Path) -> None:
    config = json.loads((recipe_tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["eos_token"] == EOS_TOKEN
    assert config["bos_token"] is None
    special_map = json.loads((recipe_tokenizer_dir / "special_tokens_map.json").read_text(encoding="utf-8"))
    assert special_map["eos_token"] == EOS_TOKEN
    tokenizer_json = json.loads((recipe_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert tokenizer_json["model"]["type"] == "BPE"


def test_auto_tokenizer_loads_and_round_trips(recipe_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(recipe_tokenizer_dir), local_files_only=True)
    assert tokenizer.is_fast
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        assert all(0 <= token_id < 4096 for token_id in ids)
        assert tokenizer.decode(ids) == text
    # Corpus words become single tokens; unseen text falls back to bytes.
    assert len(tokenizer.encode(" sparrow")) == 1


def test_special_tokens_have_the_first_ids(recipe_tokenizer) -> None:
    assert [recipe_tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS] == [0, 1, 2]
    assert recipe_tokenizer.eos_token == IM_END
    assert recipe_tokenizer.eos_token_id == 2
    assert recipe_tokenizer.bos_token is None
    assert recipe_tokenizer.pad_token == ENDOFTEXT
    # Special tokens in text are matched whole, and no BOS/EOS is added around a prompt.
    ids = recipe_tokenizer.encode(f"{IM_START}user\nhi{IM_END}")
    assert ids[0] == 1 and ids[-1] == 2
    assert recipe_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template_is_chatml(recipe_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🐦"},
        {"role": "assistant", "content": None},
        {"role": "user",
         "content": [{"type": "text", "text": "one "}, {"type": "image"}, {"type": "text", "text": "two"}]},
    ]
    text = recipe_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🐦<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>user\none two<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = recipe_tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert without.endswith("Hi 🐦<|im_end|>\n")
    ids = recipe_tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(1) == 5 and ids.count(2) == 4


def test_every_id_decodes(recipe_tokenizer, reserved_tokenizer_dir: Path) -> None:
    for tokenizer in (recipe_tokenizer, load_tokenizer(reserved_tokenizer_dir)):
        size = len(tokenizer)
        tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
        assert all(isinstance(token, str) and token for token in tokens)
        for token_id in range(size):
            assert isinstance(tokenizer.decode([token_id]), str)
            assert isinstance(tokenizer.decode([token_id], skip_special_tokens=True), str)
    reserved = load_tokenizer(reserved_tokenizer_dir)
    last = RESERVED_VOCAB_SIZE - 1
    assert reserved.decode([last]).startswith("<|reserved_")
    assert reserved.decode([last], skip_special_tokens=True) == ""


def test_corpus_yields_multi_byte_tokens(recipe_tokenizer) -> None:
    # Some tokens hold whole multi-byte characters, others only part of one: both exist.
    whole = [t for t in range(3, 4096) if any(ord(c) > 127 for c in recipe_tokenizer.decode([t]).strip("\ufffd"))]
    partial = [t for t in range(3, 4096) if "\ufffd" in recipe_tokenizer.decode([t])]
    assert len(whole) > 50 and len(partial) > 50
