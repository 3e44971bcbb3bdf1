"""vLLM's ``ModelRegistry.register_model``: an architecture registered from a script, without a
plugin, served by an engine in its own process (the default) and in this one.

Reference: HF transformers' greedy tokens on the same weights (the registered class is a
subclass of the built-in Qwen3 model, under an architecture name only the registration knows);
``apply_model`` shows which class the engine process built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from sparrow import LLM, ModelRegistry, SamplingParams, model_registry
from sparrow.config import ConfigError
from sparrow.models.qwen3 import Qwen3ForCausalLM

ARCH = "RegisteredQwen3ForCausalLM"
PROMPTS = [[5, 77, 301, 9, 1200, 42], [880, 3, 14]]
MAX_TOKENS = 6


class RegisteredQwen3(Qwen3ForCausalLM):
    """The built-in Qwen3 model under a name of its own."""


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.delenv(model_registry.ENV_ARCHITECTURES, raising=False)
    saved = dict(model_registry._classes)
    model_registry._classes.clear()
    yield
    model_registry._classes.clear()
    model_registry._classes.update(saved)


@pytest.fixture(scope="module")
def renamed_dir(qwen3_dir, tmp_path_factory) -> str:
    """The test model, its config.json naming an architecture nothing registers."""
    target = tmp_path_factory.mktemp("registered") / "model"
    shutil.copytree(qwen3_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = [ARCH]
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.fixture(scope="module")
def hf_tokens(qwen3_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist() for prompt in PROMPTS]


def run(model_dir: str, **kwargs) -> tuple[list[list[int]], str]:
    llm = LLM(model_dir, dtype="float32", max_model_len=128, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
        return [output.outputs[0].token_ids for output in outputs], llm.apply_model(lambda m: type(m).__name__)[0]
    finally:
        llm.shutdown()


def test_a_registered_architecture_runs_in_the_engine_process(clean_registry, renamed_dir, hf_tokens):
    with pytest.raises(ConfigError, match=f"'model': config.json architectures \\['{ARCH}'\\] are not supported"):
        LLM(renamed_dir, max_model_len=128)  # refused before any engine process starts
    ModelRegistry.register_model(ARCH, RegisteredQwen3)  # the engine process imports it by its path
    assert ARCH in ModelRegistry.get_supported_archs() and "Qwen3ForCausalLM" in ModelRegistry.get_supported_archs()
    tokens, built = run(renamed_dir)
    assert tokens == hf_tokens and built == "RegisteredQwen3"


def test_registering_over_a_built_in_architecture_replaces_it(clean_registry, qwen3_dir, hf_tokens, caplog):
    with caplog.at_level("WARNING", logger="sparrow.model_registry"):
        ModelRegistry.register_model("Qwen3ForCausalLM", f"{__name__}:RegisteredQwen3")  # as an import path
    assert "already registered" in caplog.text
    tokens, built = run(qwen3_dir, multiprocess=False)
    assert tokens == hf_tokens and built == "RegisteredQwen3"


def test_bad_arguments_are_refused_naming_them(clean_registry):
    for arch, cls, field in [("", RegisteredQwen3, "model_arch"), (ARCH, "no_colon", "model_cls"),
                             (ARCH, 42, "model_cls")]:
        with pytest.raises(ValueError, match=field):
            ModelRegistry.register_model(arch, cls)
    assert os.environ.get(model_registry.ENV_ARCHITECTURES) is None


SCRIPT = """
from sparrow import LLM, ModelRegistry, SamplingParams
from sparrow.models.qwen3 import Qwen3ForCausalLM


class ScriptQwen3(Qwen3ForCausalLM):
    pass


if __name__ == "__main__":
    ModelRegistry.register_model("{arch}", ScriptQwen3)
    params = SamplingParams(temperature=0, max_tokens={max_tokens}, min_tokens={max_tokens})
    llm = LLM("{model}", dtype="float32", max_model_len=128, multiprocess=False)
    print(llm.generate({{"prompt_token_ids": {prompt}}}, params, use_tqdm=False)[0].outputs[0].token_ids)
    llm.shutdown()
    try:
        LLM("{model}", dtype="float32", max_model_len=128)
    except Exception as exc:  # the engine process cannot import ScriptQwen3: one message says why
        print("refused:", "main script" in str(exc) and "multiprocess=False" in str(exc))
"""


def test_a_class_in_the_script_serves_an_engine_in_the_same_process_only(renamed_dir, hf_tokens, tmp_path):
    """As a user runs it: ``python script.py``."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(arch=ARCH, model=renamed_dir, prompt=PROMPTS[0],
                                                    max_tokens=MAX_TOKENS)))
    env = {name: value for name, value in os.environ.items() if name != model_registry.ENV_ARCHITECTURES}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env={**env, "SPARROW_CPU_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    tokens_line, error_line = result.stdout.strip().splitlines()[-2:]
    assert json.loads(tokens_line) == hf_tokens[0]
    assert error_line == "refused: True", result.stdout + result.stderr
