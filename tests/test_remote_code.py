"""The engine arguments trust_remote_code and tokenizer_mode, as a user meets them.

Every directory is built here from the qwen3 test model (nothing is downloaded):

* a model whose config.json names its own config class and model class (``auto_map``, a custom
  ``model_type``) in Python files beside it: transformers must run that code to read the config, so
  the engine refuses it without trust_remote_code, and with it generates what transformers' own
  remote-code model generates (Sparrow runs its Qwen3 implementation, as ``architectures`` says);
* a tokenizer whose tokenizer_config.json names its own classes, ``[slow, fast]``: a pure-Python
  byte-level BPE and a subclass of the Rust-backed one, reading the same vocabulary;
* tokenizer_mode "slow": transformers 5 ignores ``use_fast=False`` (one tokenizer class per
  directory), so "slow" gives the Python class where the directory has one (its only class, or
  the slow class of its own code) and refuses a directory whose tokenizer is only the Rust one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparrow import LLM, SamplingParams
from sparrow.config import ConfigError

PROMPTS = [[5, 17, 300, 42], [1000, 7, 7, 7, 9, 123], [2048, 3]]
MAX_TOKENS = 8
TEXTS = ["Hello world, how are you?", "  two  spaces\tand a tab\n", "numbers 12345 and 'quotes' it's",
         "<|im_start|>user\nhi<|im_end|>"]

REMOTE_CONFIG = '''from transformers import Qwen3Config


class RemoteQwen3Config(Qwen3Config):
    model_type = "sparrow_remote_qwen3"
'''

REMOTE_MODEL = '''from transformers import Qwen3ForCausalLM

from .configuration_remote import RemoteQwen3Config


class RemoteQwen3ForCausalLM(Qwen3ForCausalLM):
    config_class = RemoteQwen3Config
'''

# A GPT-2 style byte-level BPE in Python (the slow class) and the Rust-backed one (the fast class).
REMOTE_TOKENIZER = r'''import json

import regex
from transformers import PreTrainedTokenizer, TokenizersBackend

PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode():
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    chars = list(visible)
    extra = 0
    for byte in range(256):
        if byte not in visible:
            visible.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(visible, map(chr, chars)))


class RemoteSlowTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "vocab.json", "merges_file": "merges.txt"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, merges_file, **kwargs):
        with open(vocab_file, encoding="utf-8") as handle:
            self.encoder = json.load(handle)
        self.decoder = {index: token for token, index in self.encoder.items()}
        with open(merges_file, encoding="utf-8") as handle:
            merges = [tuple(line.split()) for line in handle.read().split("\n")[1:] if line]
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        self.pattern = regex.compile(PATTERN)
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.encoder)

    def get_vocab(self):
        return dict(self.encoder, **self.added_tokens_encoder)

    def _bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.bpe_ranks.get(pair, float("inf")), index)
                     for index, pair in enumerate(zip(parts, parts[1:]))]
            rank, index = min(pairs)
            if rank == float("inf"):
                break
            first, second = parts[index], parts[index + 1]
            merged, position = [], 0
            while position < len(parts):
                if position < len(parts) - 1 and parts[position] == first and parts[position + 1] == second:
                    merged.append(first + second)
                    position += 2
                else:
                    merged.append(parts[position])
                    position += 1
            parts = merged
        return parts

    def _tokenize(self, text, **kwargs):
        tokens = []
        for piece in self.pattern.findall(text):
            tokens.extend(self._bpe("".join(self.byte_encoder[byte] for byte in piece.encode("utf-8"))))
        return tokens

    def _convert_token_to_id(self, token):
        return self.encoder[token]

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return bytearray(self.byte_decoder[char] for char in "".join(tokens)).decode("utf-8", errors="replace")


class RemoteFastTokenizer(TokenizersBackend):
    pass
'''


def _copy(source: str, out: Path) -> Path:
    shutil.copytree(source, out)
    return out


def _edit_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="module")
def remote_model_dir(qwen3_dir, tmp_path_factory) -> str:
    """The qwen3 test model, its config and model classes shipped as code in the directory."""
    out = _copy(qwen3_dir, tmp_path_factory.mktemp("remote") / "remote-model")
    _edit_json(out / "config.json", model_type="sparrow_remote_qwen3", architectures=["Qwen3ForCausalLM"],
               auto_map={"AutoConfig": "configuration_remote.RemoteQwen3Config",
                         "AutoModelForCausalLM": "modeling_remote.RemoteQwen3ForCausalLM"})
    (out / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (out / "modeling_remote.py").write_text(REMOTE_MODEL)
    return str(out)


@pytest.fixture(scope="module")
def remote_tokenizer_dir(remote_model_dir, tmp_path_factory) -> str:
    """The remote-code model with its tokenizer classes shipped as code too: [slow (Python), fast].
    (For a model type transformers has a tokenizer of its own for, trust_remote_code=False makes
    transformers load its own class instead of the directory's, with no error.)"""
    out = _copy(remote_model_dir, tmp_path_factory.mktemp("remote") / "remote-tokenizer")
    tokenizer_json = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in tokenizer_json["model"]["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {str(token["id"]): {key: token[key] for key in ("content", "lstrip", "normalized", "rstrip",
                                                              "single_word", "special")}
             for token in tokenizer_json["added_tokens"]}
    _edit_json(out / "tokenizer_config.json", tokenizer_class="RemoteFastTokenizer", added_tokens_decoder=added,
               auto_map={"AutoTokenizer": ["tokenization_remote.RemoteSlowTokenizer",
                                           "tokenization_remote.RemoteFastTokenizer"]})
    (out / "tokenization_remote.py").write_text(REMOTE_TOKENIZER)
    return str(out)


@pytest.fixture(scope="module")
def python_tokenizer_dir(tmp_path_factory) -> str:
    """A tokenizer directory whose only class is a Python one of transformers (ByT5's bytes)."""
    out = tmp_path_factory.mktemp("byt5-tokenizer")
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    return str(out)


def _hf_greedy(model_dir: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True, trust_remote_code=True).eval()
    assert type(model).__name__ == "RemoteQwen3ForCausalLM"  # the directory's own class ran
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                       do_sample=False, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


# -- trust_remote_code: the model's config ----------------------------------------------------------
def test_a_config_with_its_own_code_needs_trust_remote_code(remote_model_dir):
    # Refused in the frontend, before any engine process starts, naming the argument.
    with pytest.raises(ConfigError, match="trust_remote_code") as info:
        LLM(remote_model_dir, dtype="float32")
    assert "--trust-remote-code" in str(info.value)
    from sparrow.model_loader import get_hf_config

    with pytest.raises(ConfigError, match="trust_remote_code"):
        get_hf_config(remote_model_dir)
    config = get_hf_config(remote_model_dir, trust_remote_code=True)
    assert type(config).__name__ == "RemoteQwen3Config" and config.model_type == "sparrow_remote_qwen3"


def test_trusted_remote_config_generates_what_transformers_generates(remote_model_dir):
    expected = _hf_greedy(remote_model_dir)
    # The engine core in its own process (the default): it and its worker read the config too.
    llm = LLM(remote_model_dir, trust_remote_code=True, dtype="float32", max_model_len=256)
    try:
        assert llm.llm_engine.config.model.trust_remote_code is True
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected


# -- trust_remote_code: the tokenizer ------------------------------------------------------------------
def test_a_tokenizer_with_its_own_code_needs_trust_remote_code(qwen3_dir, remote_tokenizer_dir):
    with pytest.raises(ConfigError, match="trust_remote_code") as info:
        LLM(qwen3_dir, tokenizer=remote_tokenizer_dir, dtype="float32")
    assert "tokenizer" in str(info.value)


def test_trusted_remote_tokenizer_tokenizes_as_transformers(remote_tokenizer_dir):
    from transformers import AutoTokenizer

    from sparrow.engine.setup import load_tokenizer

    reference = AutoTokenizer.from_pretrained(remote_tokenizer_dir, local_files_only=True, trust_remote_code=True)
    assert type(reference).__name__ == "RemoteFastTokenizer"
    tokenizer = load_tokenizer(remote_tokenizer_dir, trust_remote_code=True)
    assert type(tokenizer).__name__ == "RemoteFastTokenizer"
    for text in TEXTS:
        assert tokenizer(text).input_ids == reference(text).input_ids


# -- tokenizer_mode -------------------------------------------------------------------------------------
def test_slow_loads_the_remote_slow_class_in_frontend_and_engine_process(remote_tokenizer_dir):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    slow_cls = get_class_from_dynamic_module("tokenization_remote.RemoteSlowTokenizer", remote_tokenizer_dir,
                                             local_files_only=True)
    reference = slow_cls.from_pretrained(remote_tokenizer_dir, local_files_only=True)
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(remote_tokenizer_dir, local_files_only=True, trust_remote_code=True)
    for text in TEXTS:  # the slow class is a faithful Python BPE: the same ids as the Rust one
        assert reference(text).input_ids == fast(text).input_ids
    loads = []
    original = slow_cls.from_pretrained.__func__
    slow_cls.from_pretrained = classmethod(lambda cls, *a, **k: loads.append(a) or original(cls, *a, **k))
    try:
        llm = LLM(remote_tokenizer_dir, trust_remote_code=True, tokenizer_mode="slow", dtype="float32",
                  max_model_len=256)
    finally:
        del slow_cls.from_pretrained
    try:
        # Loaded once in this process: the pre-flight's load (it tells whether "slow" can be honoured)
        # is the frontend's tokenizer.
        assert len(loads) == 1, loads
        tokenizer = llm.get_tokenizer()
        assert type(tokenizer).__name__ == "RemoteSlowTokenizer" and not tokenizer.is_fast
        for text in TEXTS:
            assert tokenizer(text).input_ids == reference(text).input_ids
        params = SamplingParams(temperature=0.0, max_tokens=4)
        plain = llm.generate(TEXTS[:2], params, use_tqdm=False)
        assert [list(o.prompt_token_ids) for o in plain] == [reference(text).input_ids for text in TEXTS[:2]]
        # A grammar makes the engine process load the tokenizer itself, with the same settings: it
        # gets the slow class too, which xgrammar cannot read (it reads fast, sentencepiece and
        # tiktoken tokenizers), so the request fails alone, naming the class, and the engine goes on.
        from sparrow.sampling_params import StructuredOutputsParams

        choice = SamplingParams(temperature=0.0, max_tokens=8,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        with pytest.raises(ValueError, match="RemoteSlowTokenizer.*tokenizer_mode 'slow'"):
            llm.generate(["Answer: "], choice, use_tqdm=False)
        [again] = llm.generate(TEXTS[:1], params, use_tqdm=False)
        assert list(again.outputs[0].token_ids) == list(plain[0].outputs[0].token_ids)
    finally:
        llm.shutdown()


def test_slow_without_a_python_tokenizer_is_a_config_error(qwen3_dir):
    # The test model's tokenizer is only tokenizer.json: transformers 5 has no slow class for it.
    with pytest.raises(ConfigError, match="tokenizer_mode") as info:
        LLM(qwen3_dir, tokenizer_mode="slow", dtype="float32")
    assert "use_fast=False" in str(info.value)


def test_slow_gives_a_directorys_only_python_class(qwen3_dir, python_tokenizer_dir):
    from transformers import AutoTokenizer

    from sparrow.engine.setup import load_tokenizer

    reference = AutoTokenizer.from_pretrained(python_tokenizer_dir, local_files_only=True, use_fast=False)
    for mode in ("slow", "auto"):
        tokenizer = load_tokenizer(python_tokenizer_dir, tokenizer_mode=mode)
        assert type(tokenizer) is type(reference) and not tokenizer.is_fast
        for text in TEXTS:
            assert tokenizer(text).input_ids == reference(text).input_ids
    # And the whole configuration passes its pre-flight checks.
    from sparrow.config import EngineConfig
    from sparrow.engine.setup import finalize_config

    config = finalize_config(EngineConfig.from_kwargs(model=qwen3_dir, tokenizer=python_tokenizer_dir,
                                                      tokenizer_mode="slow"))
    assert config.model.tokenizer_mode == "slow"


def test_a_start_up_refused_after_the_slow_tokenizer_loaded_keeps_no_tokenizer(monkeypatch):
    """The pre-flight hands its "slow" tokenizer to the frontend; when a later check refuses the
    configuration, no frontend will take it, and it is dropped rather than kept for the process's life."""
    from sparrow.engine import setup

    tokenizer = object()  # the built-in model's tokenizer has no slow class: any object stands for it
    handed_over = []
    monkeypatch.setattr(setup, "load_tokenizer", lambda *args: tokenizer)
    real_hand_over = setup.hand_over_tokenizer
    monkeypatch.setattr(setup, "hand_over_tokenizer", lambda *args: handed_over.append(args) or real_hand_over(*args))
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(tokenizer_mode="slow", max_model_len=256, max_num_batched_tokens=16, enable_chunked_prefill=False)
    assert handed_over and handed_over[0][-1] is tokenizer
    assert all(handed is not tokenizer for handed in setup._preflight_tokenizers.values())


# -- the command line --------------------------------------------------------------------------------------
def test_serve_has_the_flags():
    result = subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--trust-remote-code" in result.stdout and "--tokenizer-mode {auto,slow}" in result.stdout
