"""Build a model from a local Hugging Face directory and fill its weights with a model loader.

``load_model(model_dir, attn_backend_cls, dtype, device, config=...)`` reads ``config.json``,
picks the class from the architecture registry, builds the model directly on the device with
uninitialised parameters (no time spent on random init), then hands it to the
:class:`ModelLoader` the ``load_format`` engine argument names (registered through
``sparrow_register_model_loaders``). The built-ins: ``safetensors`` (``auto``) streams tensors
file by file (with tensor parallelism each tensor is a lazy safetensors slice, so a rank reads
only the rows it keeps); ``dummy`` fills random weights from the seed and reads no checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping

import torch

from sparrow.layers.parallel import ParallelContext, resolve_tp

if TYPE_CHECKING:
    from sparrow.config import EngineConfig

SAFETENSORS_INDEX = "model.safetensors.index.json"
# load_format "auto" is this loader.
AUTO_LOAD_FORMAT = "safetensors"


class WeightFileError(FileNotFoundError):
    """A weight file is missing or does not hold the tensors its index promises."""


def get_hf_config(model_dir: str | Path, trust_remote_code: bool = False, overrides: dict[str, Any] | None = None
                  ) -> Any:
    """The transformers config of a local model directory (never touches the network).

    ``trust_remote_code`` (the engine argument) lets transformers import the config class the
    directory ships (``auto_map`` in config.json); without it such a directory raises a
    :class:`~sparrow.config.ConfigError` naming the argument. ``overrides`` (the engine argument
    ``hf_overrides``) replace fields after loading (see :func:`apply_hf_overrides`)."""
    from sparrow.pooling_convert import apply_conversion_config

    config = _load_hf_config(Path(model_dir), trust_remote_code)
    if overrides:
        apply_hf_overrides(config, overrides)
    apply_conversion_config(config)  # a causal LM run as a classifier (classifier_from_token)
    return config


def model_hf_config(model: Any) -> Any:
    """The transformers config of the engine's model section (``config.model``), with its
    ``trust_remote_code`` and ``hf_overrides``, and ``disable_sliding_window`` set on it when the
    section says so (``sparrow.models.windows.attended_windows`` reads it)."""
    return with_model_settings(get_hf_config(model.model, model.trust_remote_code, model.hf_overrides), model)


def with_model_settings(hf_config: Any, model: Any) -> Any:
    if getattr(model, "disable_sliding_window", False):
        hf_config.disable_sliding_window = True
    return hf_config


def apply_hf_overrides(config: Any, overrides: dict[str, Any]) -> None:
    """Set each field of ``overrides`` on ``config`` (vLLM's hf_overrides). A dict value is merged
    into the field's current dict; ``rope_scaling`` goes into ``rope_parameters`` where the config
    keeps its RoPE settings there (transformers 5), so that ``rope_theta`` and the rest survive."""
    for key, value in overrides.items():
        target = key
        if key == "rope_scaling" and isinstance(getattr(config, "rope_parameters", None), dict):
            target = "rope_parameters"
        current = getattr(config, target, None)
        if isinstance(current, dict) and isinstance(value, dict):
            value = {**current, **value}
        setattr(config, target, value)


def _load_hf_config(model_dir: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
    try:
        # Always a bool: None would make transformers ask on stdin whether to run the code.
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True,
                                          trust_remote_code=bool(trust_remote_code))
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        from sparrow.config import ConfigError

        raise ConfigError(remote_code_message(f"the config.json of {str(model_dir)!r}")) from None


def remote_code_message(what: str) -> str:
    """The error for a directory whose Python code transformers must run while trust_remote_code is off."""
    return (f"invalid engine argument 'trust_remote_code': {what} needs the Python code the directory ships "
            "(auto_map), which runs only with trust_remote_code=True (sparrow serve --trust-remote-code); "
            "set it for a directory you trust")


def get_max_model_len(hf_config: Any) -> int:
    """The longest context the model supports: max_position_embeddings (a sliding window does not
    cut it: every built-in attention backend attends through the window)."""
    max_len = getattr(hf_config, "max_position_embeddings", None)
    if max_len is None:
        raise ValueError("config.json lacks the field 'max_position_embeddings'")
    return int(max_len)


# -- model loaders ----------------------------------------------------------------------------
class ModelLoader:
    """How a worker fills the parameters of a model it just built (vLLM's BaseModelLoader).

    Subclass it, register the class with ``sparrow_register_model_loaders`` and select it with
    the ``load_format`` engine argument. Built once per worker as ``cls(config)``.
    """

    name: ClassVar[str] = ""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config

    @classmethod
    def check_files(cls, model_dir: Path) -> None:
        """Pre-flight, in the frontend before any engine process starts: raise
        :class:`WeightFileError` naming what this loader will miss in ``model_dir``. Must be cheap
        (headers and names, never tensors). The default needs nothing beyond config.json."""

    def load_weights(self, model: torch.nn.Module, model_dir: Path, tp: ParallelContext | None) -> None:
        """Fill every parameter of ``model`` (built on its device with uninitialised memory, under
        ``torch.no_grad``). ``tp`` is this rank's tensor-parallel context: each layer's
        ``weight_loader`` takes a whole checkpoint tensor and keeps this rank's shard, which is
        what ``model.load_weights(iter_of_(name, tensor))`` does for Hugging Face names."""
        raise NotImplementedError


class SafetensorsLoader(ModelLoader):
    """The checkpoint's *.safetensors files (sharded with an index or not), one file open at a time."""

    name = "safetensors"

    @classmethod
    def check_files(cls, model_dir: Path) -> None:
        safetensors_files(model_dir)

    def load_weights(self, model: torch.nn.Module, model_dir: Path, tp: ParallelContext | None) -> None:
        weights = iter_safetensors(model_dir, tp)
        pooling = self.config is not None and self.config.model.runner == "pooling"
        if pooling:
            classify = self.config.model.convert == "classify"
            weights = causal_lm_names(weights, classify=classify,
                                      score_from_tokens=score_from_tokens(self.config, getattr(model, "config", None))
                                      if classify else None)
        loaded = model.load_weights(weights)  # type: ignore[operator]
        check_loaded = getattr(model, "check_loaded", None)  # a plugin's model may check for itself
        if callable(check_loaded) and isinstance(loaded, set):
            check_loaded(loaded)


def causal_lm_names(weights: Iterator[tuple[str, Any]], classify: bool = False,
                    score_from_tokens: tuple[str, list[int], bool] | None = None) -> Iterator[tuple[str, Any]]:
    """A pooling checkpoint's tensors under their ``*ForCausalLM`` names: an encoder saved by
    ``AutoModel`` (or Qwen3-Embedding) names them without the ``model.`` prefix, and its LM head,
    if any, is never read by a pooling model. A classifier's ``score`` layer is kept when the
    model classifies (``classify``), and dropped when it embeds. ``score_from_tokens`` (method,
    token ids, tied embeddings): vLLM's conversion of a causal LM, whose ``score.weight`` is built
    from rows of its LM head, or of the embedding table it is tied to (sparrow.pooling_convert)."""
    from sparrow.pooling_convert import score_rows

    head_name = None
    if score_from_tokens is not None:
        head_name = ("model.embed_tokens.weight", "embed_tokens.weight") if score_from_tokens[2] else \
            ("lm_head.weight",)
    for name, tensor in weights:
        if head_name is not None and name in head_name:
            yield "score.weight", score_rows(tensor, score_from_tokens[0], score_from_tokens[1])  # type: ignore[index]
        if name.startswith("lm_head."):
            continue
        if name.startswith("score."):
            if classify:
                yield name, tensor
            continue
        yield (name if name.startswith("model.") else f"model.{name}"), tensor


def score_from_tokens(config: EngineConfig, hf_config: Any = None) -> tuple[str, list[int], bool] | None:
    """(method, token ids, tied embeddings) of a causal LM converted into a classifier, or None;
    ``hf_config``: the config the model was built from (None: read it)."""
    from sparrow.pooling_convert import classifier_token_ids, conversion_method, tokenizer_for

    hf_config = hf_config if hf_config is not None else model_hf_config(config.model)
    method = conversion_method(hf_config)
    if method is None:
        return None
    token_ids = classifier_token_ids(tokenizer_for(config.model), list(hf_config.classifier_from_token))
    return method, token_ids, bool(getattr(hf_config, "tie_word_embeddings", False))


def add_classifier_head(model: torch.nn.Module, hf_config: Any, dtype: torch.dtype, device: torch.device) -> None:
    """Give ``model`` the ``score`` layer of a classifier (``convert="classify"``), as transformers
    builds it: ``Linear(hidden_size, num_labels)``, without a bias for a sequence classifier and
    with one (``token_classification_bias``, default true) for a token classifier; replicated on
    every tensor-parallel rank (the pooled hidden state is whole on each). A model class that
    brings its own ``score`` module keeps it."""
    from sparrow.pooling import architecture_is_token_classifier, num_labels

    if isinstance(getattr(model, "score", None), torch.nn.Module):
        return
    bias = architecture_is_token_classifier(hf_config) and bool(getattr(hf_config, "token_classification_bias", True))
    model.score = torch.nn.Linear(int(hf_config.hidden_size), num_labels(hf_config), bias=bias, dtype=dtype,
                                  device=device)


class DummyLoader(ModelLoader):
    """Random weights, reproducible from the ``seed`` engine argument; no checkpoint is read (vLLM's
    ``dummy``): for benchmarks and for bringing up a platform before weights are at hand."""

    name = "dummy"
    # vLLM's range: small enough that activations stay finite in float16 through any depth.
    LOW, HIGH = -1e-3, 1e-3

    def load_weights(self, model: torch.nn.Module, model_dir: Path, tp: ParallelContext | None) -> None:
        seed = self.config.model.seed if self.config is not None else 0
        generators: dict[torch.device, torch.Generator] = {}
        for _name, param in model.named_parameters():
            device = param.device
            if device not in generators:
                try:
                    generators[device] = torch.Generator(device=device).manual_seed(seed)
                except RuntimeError:  # a device without its own generator: draw on the host
                    generators[device] = torch.Generator().manual_seed(seed)
            generator = generators[device]
            if generator.device == device:
                param.data.uniform_(self.LOW, self.HIGH, generator=generator)
            else:
                values = torch.empty(param.shape, dtype=param.dtype).uniform_(self.LOW, self.HIGH, generator=generator)
                param.data.copy_(values)


def model_loader_class(load_format: str, registry: Any = None) -> type[ModelLoader]:
    """The loader class ``load_format`` names ("auto": safetensors); ValueError listing the
    registered names when none is registered under it."""
    from sparrow.plugins import Registry, get_registry, resolve_parser

    if not isinstance(registry, Registry):  # None, or an architecture mapping (see load_model)
        registry = get_registry()
    name = AUTO_LOAD_FORMAT if load_format == "auto" else load_format
    if name not in registry.model_loaders:
        raise ValueError(f"unknown load_format {load_format!r}; registered: auto, "
                         f"{', '.join(sorted(registry.model_loaders)) or 'none'}")
    return resolve_parser("model loader", name, registry.model_loaders)


def get_model_loader(config: EngineConfig | None = None, registry: Any = None) -> ModelLoader:
    """The loader of ``config.load.load_format`` (no config: safetensors), built for ``config``."""
    load_format = config.load.load_format if config is not None else "auto"
    return model_loader_class(load_format, registry)(config)


def load_model(
    model_dir: str | Path,
    attn_backend_cls: type,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: ParallelContext | None = None,
    registry: Any = None,
    config: EngineConfig | None = None,
) -> torch.nn.Module:
    """Build the model of ``model_dir`` on ``device`` in ``dtype`` and load its weights with the
    loader ``config.load.load_format`` names (no config: safetensors).

    ``registry`` is a ``{architecture: "module:Class"}`` mapping or a ``sparrow.plugins.Registry``;
    by default, the process's plugin registry.
    """
    from sparrow.models.registry import resolve_model_class

    model_dir = Path(model_dir)
    hf_config = with_model_settings(get_hf_config(model_dir, config.model.trust_remote_code,
                                                  config.model.hf_overrides), config.model) \
        if config is not None else get_hf_config(model_dir)
    model_cls = resolve_model_class(hf_config, architectures(registry))
    loader = get_model_loader(config, registry)
    from sparrow.quantization import get_quantization_method, quantization_scope

    # A quantization method decides how the linear layers hold the checkpoint's weights.
    method = get_quantization_method(config, hf_config) if config is not None else None
    with torch.no_grad(), quantization_scope(method):
        model = model_cls(hf_config, attn_backend_cls, dtype, torch.device(device), tp)
        if config is not None and config.model.runner == "pooling":
            # A pooling model never computes logits: its LM head's memory is given back unread.
            if isinstance(getattr(model, "lm_head", None), torch.nn.Module):
                model.lm_head = None
            if config.model.convert == "classify":
                add_classifier_head(model, hf_config, dtype, torch.device(device))
        loader.load_weights(model, model_dir, tp)
    return model.eval()


def architectures(registry: Any) -> Mapping[str, Any]:
    """The registry's architectures, and those registered with ``sparrow.ModelRegistry`` (which win)."""
    from sparrow.model_registry import runtime_architectures

    if registry is None:
        from sparrow.plugins import get_registry

        registry = get_registry()
    return {**(registry if isinstance(registry, Mapping) else registry.architectures), **runtime_architectures()}


def safetensors_files(model_dir: str | Path) -> dict[Path, list[str] | None]:
    """weight file -> the tensor names its index assigns to it (None: no index, take all).

    Raises :class:`WeightFileError` naming missing files (and the tensors they should hold).
    """
    model_dir = Path(model_dir)
    index_path = model_dir / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files: dict[Path, list[str]] = {}
        for name, file_name in weight_map.items():
            files.setdefault(model_dir / file_name, []).append(name)
        missing = {path: names for path, names in files.items() if not path.is_file()}
        if missing:
            details = "; ".join(
                f"{path.name} (holds {', '.join(sorted(names)[:5])}{', ...' if len(names) > 5 else ''})"
                for path, names in sorted(missing.items())
            )
            raise WeightFileError(f"missing weight files in {str(model_dir)!r}: {details}")
        return dict(sorted(files.items()))
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise WeightFileError(f"no *.safetensors weight files in {str(model_dir)!r}")
    return {path: None for path in found}


def iter_safetensors(model_dir: str | Path, tp: ParallelContext | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` for every checkpoint tensor, one file open at a time.

    With world size 1 the tensor is a ``torch.Tensor``; otherwise a lazy safetensors slice that the
    layer's weight_loader narrows to this rank's rows before anything is read.
    """
    from safetensors import safe_open

    lazy = resolve_tp(tp).world_size > 1
    for path, names in safetensors_files(model_dir).items():
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            available = set(handle.keys())
            if names is None:
                names = sorted(available)
            absent = sorted(set(names) - available)
            if absent:
                raise WeightFileError(
                    f"weight file {path.name} lacks tensors its index lists: {', '.join(absent[:20])}"
                )
            for name in names:
                yield name, handle.get_slice(name) if lazy else handle.get_tensor(name)


def checkpoint_num_parameters(model_dir: str | Path, trust_remote_code: bool = False) -> int:
    """The parameter count of the whole checkpoint, read from the safetensors headers.

    Rotary caches some exporters save are not parameters, and a tied LM head is counted once (as
    Hugging Face's ``num_parameters`` counts it). Used under tensor parallelism, where every rank
    holds only its shard.
    """
    from safetensors import safe_open

    from sparrow.models.llama import IGNORED_SUFFIXES

    tied = bool(getattr(get_hf_config(model_dir, trust_remote_code), "tie_word_embeddings", False))
    total = 0
    for path, names in safetensors_files(model_dir).items():
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in names if names is not None else handle.keys():
                if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                count = 1
                for size in handle.get_slice(name).get_shape():
                    count *= size
                total += count
    return total
