"""The model recipe of sparrow-tiny: a standard Hugging Face directory with random weights.

``build_model_dir(out_dir, arch, preset, seed)`` writes ``config.json`` (through the transformers
config class of the architecture), ``model.safetensors`` (or shards and an index), weights drawn
from a fixed-seed generator so the bytes are the same on every build, ``generation_config.json``
and the tokenizer of :mod:`sparrow.tiny.tokenizer`. Transformers loads the result with
``AutoModelForCausalLM.from_pretrained(out_dir)``; it is also the reference the engine is tested
against.

``get_builtin_model_path("sparrow-tiny")`` builds the benchmark model once into the cache
directory and returns it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

# arch -> (transformers config class, architecture name in config.json)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

PRESETS: dict[str, dict[str, Any]] = {
    # The benchmark model.
    "tiny": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=64, intermediate_size=1536, max_position_embeddings=2048),
    # For unit tests: fast on two CPU cores.
    "test": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, max_position_embeddings=2048),
}

# Llama 3.1-style rope_scaling, scaled down to the presets' context length.
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

# name -> build_model_dir arguments
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "sparrow-tiny": dict(arch="qwen3", preset="tiny", seed=0, vocab_size=4096),
}
# Bump when the recipe changes what it writes: cached builds of an older recipe are rebuilt.
RECIPE_VERSION = 1
RECIPE_FILE = "sparrow_recipe.json"

# Linear weights get std 1/sqrt(fan_in) (not HF's 0.02) so that every sublayer's output is of the
# same order as its input: attention and MLP then shape the logits as much as the embedding does,
# which keeps greedy outputs varied and makes a wrong mask or cache read visible in tests.
LINEAR_GAIN = 1.0
BIAS_STD = 0.1
NORM_WEIGHT_STD = 0.1  # norm weights are 1 + noise, so a norm that is not loaded shows up
LOGIT_STD = 4.0  # spread of the logits: greedy decoding then depends on the context
DEFAULT_SAVE_DTYPE = "bfloat16"


def build_config(arch: str = "qwen3", preset: str = "tiny", vocab_size: int = 4096, **overrides: Any) -> Any:
    """The transformers config of a preset; ``overrides`` are config fields (e.g. rope_scaling)."""
    import transformers

    from sparrow.tiny.hf_archs import HF_ARCHITECTURES, build_hf_config

    if arch not in ARCHITECTURES and arch not in HF_ARCHITECTURES:
        known = sorted([*ARCHITECTURES, *HF_ARCHITECTURES])
        raise ValueError(f"arch must be one of {', '.join(known)}, got {arch!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(sorted(PRESETS))}, got {preset!r}")
    fields: dict[str, Any] = dict(PRESETS[preset])
    fields.update(
        vocab_size=vocab_size, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
        hidden_act="silu", bos_token_id=None, dtype=DEFAULT_SAVE_DTYPE, use_cache=True,
    )
    fields.update(overrides)
    if arch in HF_ARCHITECTURES:
        return build_hf_config(arch, fields)
    config_cls_name, architecture = ARCHITECTURES[arch]
    fields["architectures"] = [architecture]
    if arch in ("qwen2", "mistral") and fields["head_dim"] * fields["num_attention_heads"] != fields["hidden_size"]:
        raise ValueError(f"{arch} needs head_dim * num_attention_heads == hidden_size")
    if arch == "qwen2":
        fields.pop("head_dim")  # Qwen2 derives it from hidden_size
    return getattr(transformers, config_cls_name)(**fields)


def checkpoint_tensors(config: Any, arch: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of the checkpoint, in a fixed order.

    kind: ``embedding``, ``linear``, ``bias``, ``norm`` or ``lm_head``.
    """
    hidden, vocab = config.hidden_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    qkv_bias = arch == "qwen2" or bool(getattr(config, "attention_bias", False))
    tensors: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "embedding")]
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}"
        for proj, rows in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            tensors.append((f"{prefix}.self_attn.{proj}.weight", (rows, hidden), "linear"))
            if qkv_bias:
                tensors.append((f"{prefix}.self_attn.{proj}.bias", (rows,), "bias"))
        tensors.append((f"{prefix}.self_attn.o_proj.weight", (hidden, q_size), "linear"))
        if arch != "qwen2" and getattr(config, "attention_bias", False):
            tensors.append((f"{prefix}.self_attn.o_proj.bias", (hidden,), "bias"))
        if arch == "qwen3":
            tensors.append((f"{prefix}.self_attn.q_norm.weight", (head_dim,), "norm"))
            tensors.append((f"{prefix}.self_attn.k_norm.weight", (head_dim,), "norm"))
        tensors.append((f"{prefix}.mlp.gate_proj.weight", (inter, hidden), "linear"))
        tensors.append((f"{prefix}.mlp.up_proj.weight", (inter, hidden), "linear"))
        tensors.append((f"{prefix}.mlp.down_proj.weight", (hidden, inter), "linear"))
        tensors.append((f"{prefix}.input_layernorm.weight", (hidden,), "norm"))
        tensors.append((f"{prefix}.post_attention_layernorm.weight", (hidden,), "norm"))
    tensors.append(("model.norm.weight", (hidden,), "norm"))
    if not config.tie_word_embeddings:
        tensors.append(("lm_head.weight", (vocab, hidden), "lm_head"))
    return tensors


def random_weights(config: Any, arch: str, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights from a CPU generator seeded with ``seed``: the same bytes on every build."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    # Tied tables serve as the LM head too, so they take the LM head's scale.
    embedding_std = LOGIT_STD / math.sqrt(config.hidden_size) if config.tie_word_embeddings else 1.0
    stds = {"embedding": embedding_std, "bias": BIAS_STD, "lm_head": LOGIT_STD / math.sqrt(config.hidden_size)}
    weights: dict[str, torch.Tensor] = {}
    for name, shape, kind in checkpoint_tensors(config, arch):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if kind == "norm":
            tensor = 1.0 + NORM_WEIGHT_STD * noise
        elif kind == "linear":
            tensor = (LINEAR_GAIN / math.sqrt(shape[1])) * noise
        else:
            tensor = stds[kind] * noise
        weights[name] = tensor.to(dtype).contiguous()
    return weights


def build_model_dir(
    out_dir: str | Path,
    arch: str = "qwen3",
    preset: str = "tiny",
    seed: int = 0,
    vocab_size: int = 4096,
    *,
    with_tokenizer: bool = True,
    max_shard_size: int | None = None,
    save_dtype: str = DEFAULT_SAVE_DTYPE,
    **overrides: Any,
) -> Path:
    """Write a Hugging Face model directory with random weights; returns its path.

    overrides: config fields, e.g. ``tie_word_embeddings=True``,
        ``rope_scaling=LLAMA3_ROPE_SCALING``, ``num_key_value_heads=1``.
    max_shard_size: bytes per safetensors file; set it to write shards and an index.
    with_tokenizer: also write the tokenizer files (sparrow.tiny.tokenizer).
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from sparrow.tiny.hf_archs import HF_ARCHITECTURES, save_random_model

    torch_dtype = getattr(torch, save_dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"save_dtype must name a torch dtype, got {save_dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(arch, preset, vocab_size, dtype=save_dtype, **overrides)
    special_ids = _special_token_ids(out, vocab_size, config.max_position_embeddings, with_tokenizer)
    config.eos_token_id = special_ids["eos"]
    config.pad_token_id = special_ids["pad"]
    config.save_pretrained(str(out))
    if arch in HF_ARCHITECTURES:
        if max_shard_size is not None:
            raise ValueError(f"max_shard_size is not supported for arch {arch!r}")
        save_random_model(out, config, arch, seed, torch_dtype)  # rewrites the generation config
    else:
        weights = random_weights(config, arch, seed, torch_dtype)
        for file_name, shard in _shards(weights, max_shard_size).items():
            save_file(shard, str(out / file_name), metadata={"format": "pt"})
        if max_shard_size is not None:
            _write_index(out, weights, max_shard_size)
    GenerationConfig(
        bos_token_id=None, eos_token_id=[special_ids["eos"], special_ids["pad"]],
        pad_token_id=special_ids["pad"],
    ).save_pretrained(str(out))
    return out


def _special_token_ids(out: Path, vocab_size: int, max_len: int, with_tokenizer: bool) -> dict[str, int]:
    from sparrow.tiny import tokenizer as tiny_tokenizer

    if with_tokenizer:
        tiny_tokenizer.build_tokenizer(out, vocab_size, model_max_length=max_len)
        added = json.loads((out / tiny_tokenizer.TOKENIZER_FILE).read_text())["added_tokens"]
        ids = {token["content"]: token["id"] for token in added}
    else:  # the tokenizer recipe trains its special tokens first, in this order
        ids = {token: index for index, token in enumerate(tiny_tokenizer.SPECIAL_TOKENS)}
    return {"eos": ids[tiny_tokenizer.EOS_TOKEN], "pad": ids[tiny_tokenizer.PAD_TOKEN]}


def _shards(weights: dict[str, torch.Tensor], max_shard_size: int | None) -> dict[str, dict[str, torch.Tensor]]:
    """file name -> tensors, filling files in checkpoint order up to max_shard_size bytes."""
    if max_shard_size is None:
        return {"model.safetensors": weights}
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be > 0 bytes, got {max_shard_size}")
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    count = len(groups)
    return {f"model-{i + 1:05d}-of-{count:05d}.safetensors": group for i, group in enumerate(groups)}


def _write_index(out: Path, weights: dict[str, torch.Tensor], max_shard_size: int) -> None:
    weight_map = {name: file_name for file_name, shard in _shards(weights, max_shard_size).items() for name in shard}
    total_size = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# The built-in model cache
# ---------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$SPARROW_CACHE_DIR``, default ``~/.cache/sparrow``."""
    return Path(os.environ.get("SPARROW_CACHE_DIR") or Path.home() / ".cache" / "sparrow").expanduser()


def get_builtin_model_path(name: str = "sparrow-tiny") -> Path:
    """The directory of a built-in model, built on first use (atomically: temp dir, then rename)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {', '.join(sorted(BUILTIN_MODELS))}")
    recipe = {"name": name, "recipe_version": RECIPE_VERSION, **BUILTIN_MODELS[name]}
    models_dir = cache_root() / "models"
    final = models_dir / name
    if _built_by(final) == recipe:
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-building-", dir=models_dir))
    try:
        build_model_dir(staging, **BUILTIN_MODELS[name])
        (staging / RECIPE_FILE).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
        _replace_dir(staging, final, recipe)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _built_by(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _replace_dir(staging: Path, final: Path, recipe: dict[str, Any]) -> None:
    """Move ``staging`` to ``final``; a stale ``final`` is moved aside first. Another process that
    finished the same build first wins, and this one's copy is dropped."""
    if final.exists() and _built_by(final) != recipe:
        stale = Path(tempfile.mkdtemp(prefix=f".{final.name}-stale-", dir=final.parent))
        try:
            os.replace(final, stale / final.name)
        except OSError:
            pass  # someone else moved it already
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, final)
    except OSError:
        if _built_by(final) != recipe:
            raise
