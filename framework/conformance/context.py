"""What every check of one run shares: the platform under test, its dtype and device, and the tiny
models the engine checks load (built once per run, or reused from ``model_dir``)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sparrow.platforms import resolve_platform

# arch -> sparrow.tiny.model.build_model_dir arguments: the built-in architectures' test models
# (the same recipes as the kernel's own parity tests). Llama covers GQA with unequal head counts,
# untied embeddings and llama3 rope scaling; Qwen2 QKV biases and tied embeddings; Qwen3 q/k norms.
TEST_MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", preset="test", seed=1, tie_word_embeddings=False, rope_scaling="llama3"),
    "qwen2": dict(arch="qwen2", preset="test", seed=2, tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", preset="test", seed=3, tie_word_embeddings=False),
}
VOCAB_SIZE = 4096
RECIPE_FILE = "sparrow_conformance.json"
TOKENIZER_DIR = "tokenizer"
# Engine runs stay small: the whole suite must run in a couple of minutes on a CPU.
MAX_MODEL_LEN = 256


class ConformanceContext:
    """One conformance run on ``device``; :meth:`close` removes what it built in a temporary
    directory (never a ``model_dir`` the caller gave, which caches the models between runs)."""

    def __init__(self, device: str, *, model_dir: str | Path | None = None, dtype: str | None = None) -> None:
        import torch

        if not isinstance(device, str) or not device:
            raise ValueError(f"device must be a platform name, got {device!r}")
        self.device = device
        self.platform = resolve_platform(device)
        self.dtype = self.platform.resolve_dtype(dtype or "auto")
        torch_dtype = getattr(torch, self.dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype")
        self.torch_dtype: torch.dtype = torch_dtype
        self.torch_device: torch.device = torch.device(self.platform.device_for_rank(0))
        # Token-for-token equality with Hugging Face needs float32; a platform without it is
        # compared in its own dtype (near-ties then decide more tokens).
        self.engine_dtype = "float32" if "float32" in self.platform.supported_dtypes else self.dtype
        self._own_dir = model_dir is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="sparrow-conformance-") if model_dir is None else model_dir)

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> ConformanceContext:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- the platform's pieces -----------------------------------------------------------------
    def registry(self) -> Any:
        from sparrow.plugins import get_registry

        return get_registry()

    def attention_backend_cls(self, num_heads: int, num_kv_heads: int, head_dim: int) -> type:
        """The backend the platform's worker would choose (``attention_backend="auto"``)."""
        from sparrow.plugins import check_attention_backend, get_plugin_manager
        from sparrow.tiny.model import build_config

        model_config = build_config("qwen3", "test", VOCAB_SIZE, num_attention_heads=num_heads,
                                    num_key_value_heads=num_kv_heads, head_dim=head_dim, dtype=self.dtype)
        pm = get_plugin_manager()
        backend = check_attention_backend(pm, pm.hook.sparrow_attention_backend(
            platform=self.platform, requested="auto", model_config=model_config))
        if backend is None:
            raise LookupError(f"no plugin answered sparrow_attention_backend for platform {self.platform.name!r} "
                              f"(requested 'auto')")
        return backend

    # -- models --------------------------------------------------------------------------------
    def model_dir(self, arch: str) -> str:
        """The test model of ``arch`` (built on first use; reused when its recipe matches)."""
        from sparrow.tiny.model import LLAMA3_ROPE_SCALING, build_model_dir

        spec = dict(TEST_MODELS[arch])
        if spec.get("rope_scaling") == "llama3":
            spec["rope_scaling"] = dict(LLAMA3_ROPE_SCALING)
        out = self.work_dir / arch
        recipe = {"vocab_size": VOCAB_SIZE, "save_dtype": "float32", **spec}
        if not _recipe_matches(out, recipe):
            shutil.rmtree(out, ignore_errors=True)
            # One tokenizer serves every model (same vocabulary): only its ids matter here.
            build_model_dir(out, vocab_size=VOCAB_SIZE, save_dtype="float32", with_tokenizer=False, **spec)
            (out / RECIPE_FILE).write_text(json.dumps(recipe, sort_keys=True))
        return str(out)

    def tokenizer_dir(self) -> str:
        from sparrow.tiny.tokenizer import TOKENIZER_FILE, build_tokenizer

        out = self.work_dir / TOKENIZER_DIR
        if not (out / TOKENIZER_FILE).is_file():
            build_tokenizer(out, VOCAB_SIZE, model_max_length=MAX_MODEL_LEN)
        return str(out)

    def llm(self, arch: str, **engine_args: Any) -> Any:
        """An in-process engine on the platform under test, loading the test model of ``arch``."""
        from sparrow import LLM

        args: dict[str, Any] = dict(device=self.device, dtype=self.engine_dtype, max_model_len=MAX_MODEL_LEN,
                                    tokenizer=self.tokenizer_dir(), seed=0)
        args.update(engine_args)
        return LLM(self.model_dir(arch), multiprocess=False, **args)

    def hf_model(self, arch: str) -> Any:
        """Hugging Face transformers' model of ``arch`` in the engine's dtype, on the CPU: the
        reference every platform is compared with."""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        # Its weight-loading progress bar would cut through the results table.
        bar_was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir(arch), dtype=getattr(torch, self.engine_dtype),
                                                         attn_implementation="eager", local_files_only=True)
        finally:
            if bar_was_enabled:
                hf_logging.enable_progress_bar()
        return model.eval()


def _recipe_matches(out: Path, recipe: dict[str, Any]) -> bool:
    try:
        return json.loads((out / RECIPE_FILE).read_text()) == json.loads(json.dumps(recipe, sort_keys=True))
    except (OSError, ValueError):
        return False
