"""Build a model from a local Hugging Face directory and stream its safetensors weights into it.

``load_model(model_dir, attn_backend_cls, dtype, device)`` reads ``config.json``, picks the class
from the architecture registry, builds the model directly on the device with uninitialised
parameters (no time spent on random init), then streams tensors file by file. With tensor
parallelism each tensor is handed over as a lazy safetensors slice, so a rank reads only the rows
it keeps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from sparrow.layers.parallel import ParallelContext, resolve_tp

SAFETENSORS_INDEX = "model.safetensors.index.json"


class WeightFileError(FileNotFoundError):
    """A weight file is missing or does not hold the tensors its index promises."""


def get_hf_config(model_dir: str | Path) -> Any:
    """The transformers config of a local model directory (never touches the network)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def get_max_model_len(hf_config: Any) -> int:
    """The longest context the model supports: max_position_embeddings, capped by an active
    sliding window (full attention equals sliding attention while the context fits the window)."""
    max_len = getattr(hf_config, "max_position_embeddings", None)
    if max_len is None:
        raise ValueError("config.json lacks the field 'max_position_embeddings'")
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        max_len = min(max_len, int(window))
    return int(max_len)


def load_model(
    model_dir: str | Path,
    attn_backend_cls: type,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: ParallelContext | None = None,
    registry: Any = None,
) -> torch.nn.Module:
    """Build the model of ``model_dir`` on ``device`` in ``dtype`` and load its weights.

    ``registry`` is a ``{architecture: "module:Class"}`` mapping or a ``sparrow.plugins.Registry``;
    by default, the process's plugin registry.
    """
    from sparrow.models.registry import resolve_model_class

    model_dir = Path(model_dir)
    hf_config = get_hf_config(model_dir)
    model_cls = resolve_model_class(hf_config, _architectures(registry))
    with torch.no_grad():
        model = model_cls(hf_config, attn_backend_cls, dtype, torch.device(device), tp)
        model.load_weights(iter_safetensors(model_dir, tp))
    return model.eval()


def _architectures(registry: Any) -> Mapping[str, str]:
    if registry is None:
        from sparrow.plugins import get_registry

        registry = get_registry()
    return registry if isinstance(registry, Mapping) else registry.architectures


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


def checkpoint_num_parameters(model_dir: str | Path) -> int:
    """The parameter count of the whole checkpoint, read from the safetensors headers.

    Rotary caches some exporters save are not parameters, and a tied LM head is counted once (as
    Hugging Face's ``num_parameters`` counts it). Used under tensor parallelism, where every rank
    holds only its shard.
    """
    from safetensors import safe_open

    from sparrow.models.llama import IGNORED_SUFFIXES

    tied = bool(getattr(get_hf_config(model_dir), "tie_word_embeddings", False))
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
