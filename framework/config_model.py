"""The model section of the engine configuration (:class:`ModelConfig`): which checkpoint and
tokenizer run, in which dtype, and what a request's generation defaults to and may ask for
(generation config, logprobs, structured outputs, reasoning parser, logits processors).

``sparrow.config`` re-exports :class:`ModelConfig` and ``DTYPES``; import them from there.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from sparrow.config_base import _Section, expand_dict_argument

logger = logging.getLogger("sparrow.config")  # the name its log lines had before the split

DTYPES = ("auto", "float32", "bfloat16", "float16")


class ModelConfig(_Section):
    # Every description is also the --help text of its flag: say what the value does and, where
    # the default is None, what None means ("(default: ...)"); the CLI appends other defaults.
    model: str | None = Field(None, description="Local Hugging Face model directory (config.json, *.safetensors, "
                              "tokenizer files), or a Hub id (org/name) already in the Hugging Face cache; never "
                              "downloaded (default: the built-in sparrow-tiny).")
    tokenizer: str | None = Field(None, description="Tokenizer directory, or a Hub id in the Hugging Face cache "
                                  "(default: the model directory).")
    revision: str | None = Field(None, description="The revision (branch, tag or commit) of a Hub id model, read "
                                 "from the Hugging Face cache (default: main).")
    tokenizer_revision: str | None = Field(None, description="The revision of a Hub id tokenizer (default: main).")
    download_dir: str | None = Field(None, description="The Hugging Face cache a Hub id is read from; Sparrow never "
                                     "downloads into it (default: HF_HUB_CACHE).")
    runner: str = Field("auto", description="vLLM's model runner kind: generate (text), pooling (one vector per "
                        "prompt: LLM.embed, /v1/embeddings, LLM.classify, /classify) or auto (pooling for an encoder "
                        "architecture such as Qwen3Model or a *ForSequenceClassification one, else generate).")
    task: str = Field("auto", description="vLLM's older name for runner: auto, generate, embed, or classify / score "
                      "(runner pooling with the checkpoint's classification head).")
    convert: str = Field("auto", description="vLLM's model conversion: auto, none, embed (run a *ForCausalLM "
                         "checkpoint such as Qwen3-Embedding as an embedding model; implies runner pooling) or "
                         "classify (a *ForSequenceClassification checkpoint's score head; the default for one).")
    pooler_config: dict[str, Any] | None = Field(
        None, description="A pooling model's pooler, e.g. '{\"pooling_type\": \"MEAN\", \"normalize\": true}': "
        "pooling_type LAST, MEAN or CLS, normalize (L2) true or false (default: the directory's "
        "sentence-transformers files, else LAST, normalized).")
    override_pooler_config: dict[str, Any] | None = Field(
        None, description="vLLM's older name for pooler_config (default: none).")
    dtype: str = Field("auto", description="Weight and activation dtype: auto, float32, bfloat16 or float16; "
                       "auto is the platform's choice (CPU float32, CUDA bfloat16).")
    max_model_len: int | None = Field(None, gt=0, description="Longest context, prompt plus output, in tokens "
                                      "(default: the model's max_position_embeddings).")
    seed: int = Field(0, ge=0, description="Seed for requests without their own seed and for load_format=dummy "
                      "weights (None: a random one, chosen once at start-up and logged).")
    served_model_name: str | None = Field(None, description="Model name the server reports and accepts "
                                          "(default: the model path).")
    structured_outputs_any_whitespace: bool = Field(
        False, description="Structured outputs: let JSON grammars put any whitespace between tokens (the "
        "default allows only compact JSON, so that a weak model cannot emit whitespace until max_tokens; "
        "vLLM's disable_any_whitespace, inverted).")
    structured_outputs_config: dict[str, Any] | None = Field(
        None, description="vLLM's StructuredOutputsConfig as one dict: backend (auto or xgrammar, the one Sparrow "
        "has), disable_any_whitespace (the inverse of structured_outputs_any_whitespace), reasoning_parser, "
        "reasoning_parser_plugin, and disable_fallback, disable_additional_properties and enable_in_reasoning at "
        "the values Sparrow runs (no fallback backend, closed JSON objects, grammars after the reasoning).")
    structured_outputs_compile_timeout: float = Field(
        30.0, gt=0, description="Structured outputs: seconds a grammar may take to compile; a request whose grammar "
        "takes longer fails, and the compile is stopped (a short regex can take xgrammar minutes).")
    structured_outputs_mask_budget_ms: float = Field(
        100.0, gt=0, description="Structured outputs: milliseconds one request's grammar may take to compute a "
        "token mask. A grammar over it at its first token fails its request at compile time; one over it on "
        "three steps fails then (every request in the batch waits for the masks).")
    reasoning_parser: str | None = Field(
        None, description="How the model marks its reasoning: qwen3, deepseek_r1, deepseek_v3, glm45 "
        "(<think>...</think>), mistral ([THINK]...[/THINK]) or a plugin's. The server splits reasoning_content "
        "from content, and structured outputs apply only after the reasoning ends (default: none).")
    reasoning_parser_plugin: str | None = Field(
        None, description="A Python file that registers reasoning parsers (a sparrow_register_reasoning_parsers "
        "hook implementation), loaded in every engine process before reasoning_parser is looked up: a parser "
        "that is not an installed plugin (default: none).")
    logits_processors: list[str] | None = Field(
        None, description="Logits processors to enable besides the built-ins: names registered by plugins "
        "(`sparrow plugins` lists them) or qualified names package.module:Class (default: the built-ins only).")
    quantization: str | None = Field(
        None, description="Quantization method for the weights: a name a plugin registers (`sparrow plugins` "
        "lists them) (default: none, the weights run in dtype).")
    skip_tokenizer_init: bool = Field(
        False, description="Load no tokenizer (vLLM's): prompts must be token ids, outputs carry token ids and "
        "empty text; stop strings, chat, bad_words, structured outputs and a reasoning parser are refused.")
    enable_sleep_mode: bool = Field(
        False, description="Allow LLM.sleep() / wake_up(): release the KV cache and the weights' device memory "
        "while another program uses the device (RLHF), then take it back.")
    trust_remote_code: bool = Field(
        False, description="Let transformers run the Python code a model or tokenizer directory ships for its config "
        "or tokenizer class (auto_map in config.json / tokenizer_config.json); only for directories you trust. The "
        "model itself always runs Sparrow's implementation of its architecture.")
    hf_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Values that replace the model's config.json fields, e.g. "
        "'{\"max_position_embeddings\": 131072, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
        "\"original_max_position_embeddings\": 32768}}'; a dict value is merged into the field's dict (rope_scaling "
        "into rope_parameters, keeping rope_theta).")
    tokenizer_mode: Literal["auto", "slow"] = Field(
        "auto", description="auto: the fast (Rust) tokenizer when the directory has one; slow: the Python "
        "tokenizer class, where the directory has one (its own code's slow class, with trust_remote_code, or a "
        "Python-only tokenizer; transformers 5 has no slow twin of a fast tokenizer, so a fast-only directory is "
        "refused). vLLM's mistral and custom modes are not supported.")
    generation_config: str = Field(
        "auto", min_length=1, description="Where the default sampling parameters come from: auto (the model "
        "directory's generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, and "
        "max_new_tokens as max_tokens), vllm (the neutral defaults; the file is ignored), or a directory holding a "
        "generation_config.json. Used where a request leaves a parameter unset.")
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict, description="Generation-config values that replace the file's, e.g. "
        "'{\"temperature\": 0.5}'; a max_new_tokens here also caps every request's max_tokens on the server.")
    max_logprobs: int = Field(
        20, ge=-1, description="Most log probabilities per token a request may ask for (logprobs, prompt_logprobs, "
        "top_logprobs); -1: the vocabulary size.")
    disable_sliding_window: bool = Field(
        False, description="vLLM's: attend to the whole context in sliding-window layers, with max_model_len cut "
        "to the window (so that outputs are the model's); a model without a window is unchanged.")
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = Field(
        "raw_logprobs", description="vLLM's: what a sampled token's logprobs report: the model's log-probabilities "
        "(raw_logprobs) or logits (raw_logits), or those the token was drawn from after the logits processors, "
        "penalties, temperature and min-p/top-k/top-p filters (processed_logprobs, processed_logits; filtered-out "
        "tokens at -inf). Prompt logprobs are always the model's.")
    enable_prompt_embeds: bool = Field(
        False, description="vLLM's: accept prompts given as embeddings ({'prompt_embeds': tensor [tokens, "
        "hidden_size]} offline, a base64 torch.save'd tensor in /v1/completions' prompt_embeds), fed to the model "
        "in place of its token embeddings. The server then loads tensors that clients send (torch.load with "
        "weights_only=True); off by default.")

    @model_validator(mode="before")
    @classmethod
    def _vllm_dict(cls, values: Any) -> Any:
        return expand_dict_argument(values, "structured_outputs_config", _structured_outputs_key)

    @field_validator("logits_processors", mode="before")
    @classmethod
    def _processor_names(cls, value: Any) -> Any:
        # vLLM also takes classes: they travel to the engine's processes as "module:QualName",
        # which must be importable there (the name is checked before any process starts).
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ValueError("must be a list of names or 'package.module:Class' strings (or classes)")
        names = []
        for item in value:
            if isinstance(item, type):
                if "<locals>" in item.__qualname__:
                    raise ValueError(f"{item.__qualname__} is defined inside a function, so no other process can "
                                     "import it; define it at module level")
                item = f"{item.__module__}:{item.__qualname__}"
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"every entry must be a non-empty name or class, got {item!r}")
            names.append(item.strip())
        return names

    @field_validator("seed", mode="before")
    @classmethod
    def _random_seed(cls, value: Any) -> Any:
        # vLLM's seed=None: not reproducible run to run; one seed drawn here serves every process.
        if value is None:
            seed = random.SystemRandom().randrange(2**31)
            logger.info("seed=None: using seed %d", seed)
            return seed
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _torch_dtype_name(cls, value: Any) -> Any:
        # vLLM takes a torch.dtype too (torch.bfloat16 -> "bfloat16"), without importing torch here.
        if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
            return str(value).removeprefix("torch.")
        return value

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        aliases = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}
        value = aliases.get(value, value)
        if value not in DTYPES:
            raise ValueError(f"must be one of {', '.join(DTYPES)}")
        return value

    @field_validator("runner", "task", "convert")
    @classmethod
    def _model_kinds(cls, value: str, info: Any) -> str:
        allowed = {"runner": ("auto", "generate", "pooling"), "task": ("auto", "generate", "embed", "classify",
                                                                         "score"),
                   "convert": ("auto", "none", "embed", "classify")}[info.field_name]
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)} (Sparrow's pooling models embed or classify: "
                             "reward models are not supported)")
        return value

    @field_validator("pooler_config", "override_pooler_config")
    @classmethod
    def _pooler_keys(cls, value: dict[str, Any] | None, info: Any) -> dict[str, Any] | None:
        from sparrow.pooling import check_pooler_config

        return None if value is None else check_pooler_config(value, info.field_name)



def _structured_outputs_key(key: str, value: Any) -> dict[str, Any]:
    """One key of vLLM's structured_outputs_config as Sparrow's flat fields (ValueError for a
    value Sparrow does not run)."""
    where = f"structured_outputs_config.{key}"
    if key not in _STRUCTURED_OUTPUTS_KEYS:
        raise ValueError(f"{where} is not one of vLLM's keys Sparrow takes ({', '.join(_STRUCTURED_OUTPUTS_KEYS)})")
    if key == "backend":
        if value not in ("auto", "xgrammar"):
            raise ValueError(f"{where}: Sparrow's structured outputs run on xgrammar ('auto' or 'xgrammar'), not "
                             f"{value!r}")
        return {}
    if key in ("reasoning_parser", "reasoning_parser_plugin"):
        return {key: value} if value else {}  # vLLM's "" is none
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if key == "disable_any_whitespace":
        return {"structured_outputs_any_whitespace": not value}
    if key in ("disable_fallback", "disable_additional_properties"):
        return {}  # both hold either way: one backend; xgrammar closes objects a schema leaves open
    if value:  # enable_in_reasoning
        raise ValueError(f"{where}: the grammar constrains the answer only, after the reasoning ends")
    return {}


_STRUCTURED_OUTPUTS_KEYS = ("backend", "disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                            "reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning")
