"""Pre-flight checks of the files an engine will read (see :mod:`sparrow.engine.preflight`, which
runs them): the model directory, the weights its loader reads, the tokenizer files and mode."""

from __future__ import annotations

from pathlib import Path

from sparrow.config import ConfigError, EngineConfig
from sparrow.hub_cache import looks_like_hub_id
from sparrow.plugins import Registry

# A tokenizer directory holds at least one of these (fast, sentencepiece or BPE vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _error(field: str, message: str) -> ConfigError:
    return ConfigError(f"invalid engine argument {field!r}: {message}")


# -- files ----------------------------------------------------------------------------------------
def check_model_dir(model: str) -> Path:
    """``model`` as a directory with a config.json, or ConfigError naming what is missing."""
    path = Path(model).expanduser()
    if not path.exists():
        hint = ""
        if looks_like_hub_id(model):
            hint = (f", nor is it in the Hugging Face cache; download it first (for example `hf download {model}`, "
                    "then pass the same id or the directory)")
        raise _error("model", f"{model!r} does not exist{hint}; Sparrow loads local Hugging Face model directories "
                     "(or Hub ids already in the Hugging Face cache) and never downloads models")
    if not path.is_dir():
        raise _error("model", f"{model!r} is not a directory (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise _error("model", f"{model!r} has no config.json, so it is not a Hugging Face model directory")
    return path


def check_model_files(model: str, tokenizer: str | None, load_format: str = "auto",
                      registry: Registry | None = None, check_tokenizer: bool = True) -> None:
    """Weights (as the ``load_format`` loader reads them) and tokenizer files are where the engine
    will look for them."""
    from sparrow.model_loader import WeightFileError, model_loader_class

    path = check_model_dir(model)
    try:
        loader_cls = model_loader_class(load_format, registry)
    except ValueError as exc:
        raise _error("load_format", str(exc)) from None
    try:
        loader_cls.check_files(path)
    except WeightFileError as exc:
        hint = " (load_format 'auto' reads *.safetensors files)" if load_format in ("auto", "safetensors") else ""
        raise _error("model", f"{exc}{hint}") from None
    if not check_tokenizer:  # skip_tokenizer_init
        return
    tokenizer_dir = Path(tokenizer or model).expanduser()
    default_note = " (the tokenizer defaults to the model directory)" if tokenizer in (None, model) else ""
    if not tokenizer_dir.is_dir():
        raise _error("tokenizer", f"{str(tokenizer_dir)!r} is not a directory{default_note}")
    if not any((tokenizer_dir / name).is_file() for name in TOKENIZER_FILES):
        raise _error("tokenizer", f"{str(tokenizer_dir)!r} holds no tokenizer files (one of "
                     f"{', '.join(TOKENIZER_FILES)}){default_note}")


def check_tokenizer_mode(config: EngineConfig) -> None:
    """tokenizer_mode "slow": the tokenizer loads as a Python one (loading it is the only sure
    test of which class transformers picks; the frontend then takes this one instead of loading it
    again. "auto" loads it once, in the frontend)."""
    if config.model.tokenizer_mode != "slow":
        return
    from sparrow.engine.setup import hand_over_tokenizer, load_tokenizer

    path, trust_remote_code = config.model.tokenizer or str(config.model.model), config.model.trust_remote_code
    hand_over_tokenizer(path, trust_remote_code, "slow", load_tokenizer(path, trust_remote_code, "slow"))
