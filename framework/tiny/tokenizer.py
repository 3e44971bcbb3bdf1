"""The tokenizer recipe of sparrow-tiny: a byte-level BPE trained on a corpus shipped with the package.

Nothing is downloaded. The same corpus and ``vocab_size`` give the same bytes on every machine, so
a cached model directory can be compared with a fresh build. The vocabulary has exactly
``vocab_size`` ids: a model with random weights samples every id of its embedding matrix, so every
id must exist and decode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Trained first, so they get ids 0, 1, 2 in this order.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
EOS_TOKEN = IM_END
PAD_TOKEN = ENDOFTEXT
# Fillers when training yields fewer ids than asked for (the Llama 3 / Qwen habit of reserved ids).
RESERVED_TOKEN_TEMPLATE = "<|reserved_{}|>"

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

# 256 byte symbols, every one reachable, plus the special tokens.
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)

# ChatML. Content may be a string, None (an assistant turn that only called tools) or a list of
# OpenAI-style parts, of which the text parts are kept.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is not none else '' -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if content is string -%}"
    "{{- content -}}"
    "{%- else -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"


def _read_corpus(corpus_path: Path) -> list[str]:
    # Paragraphs, in file order: the trainer counts words, so the split only has to be stable.
    text = corpus_path.read_text(encoding="utf-8")
    return [paragraph for paragraph in text.split("\n\n") if paragraph.strip()]


def _train(vocab_size: int, corpus_path: Path) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # No normalizer: decode(encode(text)) must give back the exact text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # Merge even pairs seen once: the corpus is small, and with random weights every id gets
        # sampled, so real text pieces make better demo output than reserved fillers.
        min_frequency=1,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        # All 256 bytes, whether or not the corpus uses them: any text must be encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_read_corpus(corpus_path), trainer=trainer)

    num_trained = tokenizer.get_vocab_size(with_added_tokens=True)
    if num_trained > vocab_size:
        raise RuntimeError(f"BPE training produced {num_trained} ids, more than vocab_size={vocab_size}")
    reserved = [
        AddedToken(RESERVED_TOKEN_TEMPLATE.format(index), special=True, normalized=False)
        for index in range(vocab_size - num_trained)
    ]
    if reserved:
        tokenizer.add_special_tokens(reserved)
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError("reserved tokens did not fill the vocabulary to vocab_size")
    return tokenizer


def _tokenizer_config(model_max_length: int | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # The default (True) rewrites " ." to "." and would break the exact round trip.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


def _special_tokens_map() -> dict[str, Any]:
    return {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(SPECIAL_TOKENS),
    }


def _write_json(path: Path, content: dict[str, Any]) -> None:
    # Sorted keys and a fixed layout: the files are part of the reproducible build.
    path.write_text(json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 4096,
    *,
    corpus_path: str | Path | None = None,
    model_max_length: int | None = None,
) -> None:
    """Train the byte-level BPE on the packaged corpus and write a Hugging Face tokenizer directory.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (with the ChatML ``chat_template``) and
    ``special_tokens_map.json`` into ``out_dir`` (created if missing). Ids are exactly
    ``0..vocab_size-1``: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` first, then the 256
    bytes and the merges, then ``<|reserved_N|>`` special tokens if training stopped short.
    """
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} (256 bytes + special tokens), got {vocab_size!r}"
        )
    if model_max_length is not None and model_max_length < 1:
        raise ValueError(f"model_max_length must be >= 1, got {model_max_length!r}")
    corpus = Path(corpus_path) if corpus_path is not None else CORPUS_PATH
    if not corpus.is_file():
        raise ValueError(f"corpus_path {str(corpus)!r} is not a file")

    tokenizer = _train(vocab_size, corpus)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER_FILE).write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out / TOKENIZER_CONFIG_FILE, _tokenizer_config(model_max_length))
    _write_json(out / SPECIAL_TOKENS_MAP_FILE, _special_tokens_map())


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer directory from local files only (never the hub)."""
    from transformers import AutoTokenizer

    directory = Path(path)
    if not (directory / TOKENIZER_FILE).is_file() and not (directory / TOKENIZER_CONFIG_FILE).is_file():
        raise ValueError(f"tokenizer path {str(path)!r} holds no {TOKENIZER_FILE} or {TOKENIZER_CONFIG_FILE}")
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
