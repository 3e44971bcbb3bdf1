"""A draft model for speculative decoding made from a target model: its first layers.

``build_draft_dir(target_dir, out_dir, num_layers=1)`` writes a Hugging Face directory with the
target's config (``num_hidden_layers`` cut to ``num_layers``), its tokenizer files, its embedding,
final norm and LM head, and its first ``num_layers`` decoder layers. The result shares the
target's vocabulary by construction and agrees with it more often than an unrelated random model
would (a layer-skipping "self-draft"), which makes it a useful tiny draft for tests and docs:

    from sparrow.tiny.draft import build_draft_dir
    from sparrow.tiny.model import get_builtin_model_path

    draft = build_draft_dir(get_builtin_model_path(), "/tmp/sparrow-tiny-draft", num_layers=2)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

# Files copied as they are (tokenizer and generation settings).
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "vocab.json", "merges.txt", "tokenizer.model")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def build_draft_dir(target_dir: str | Path, out_dir: str | Path, num_layers: int = 1) -> Path:
    """Write the first ``num_layers`` layers of ``target_dir`` as a model directory; returns it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from sparrow.model_loader import safetensors_files

    target, out = Path(target_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(str(target), local_files_only=True)
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"num_layers must be between 1 and the target's {config.num_hidden_layers} layers, "
                         f"got {num_layers}")
    out.mkdir(parents=True, exist_ok=True)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (transformers 5)
        config.layer_types = config.layer_types[:num_layers]
    config.save_pretrained(str(out))
    weights = {}
    for path in safetensors_files(target):
        for name, tensor in load_file(str(path)).items():
            match = _LAYER.match(name)
            if match is None or int(match.group(1)) < num_layers:
                weights[name] = tensor
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED_FILES:
        if (target / name).is_file():
            shutil.copyfile(target / name, out / name)
    return out
