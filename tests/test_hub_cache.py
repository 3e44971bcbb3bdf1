"""A Hugging Face Hub id (``LLM("org/name")``, as vLLM users write it) is the snapshot already in
the Hugging Face cache; nothing is ever downloaded. Run as a user runs it: a script in a fresh
process with ``HF_HUB_CACHE`` pointing at a cache laid out as huggingface_hub lays it out, offline,
and checked against HF transformers on the snapshot directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO_ID = "sparrow-test/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

SCRIPT = textwrap.dedent(f"""
    import json
    from sparrow import LLM, SamplingParams

    llm = LLM({REPO_ID!r}, max_model_len=128, num_kv_blocks=16, dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [out] = llm.generate(["The sparrow"], params, use_tqdm=False)
    print(json.dumps({{"model": llm.llm_engine.config.model.model,
                       "served": llm.llm_engine.config.model.served_model_name,
                       "prompt": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids)}}))
    llm.shutdown()
""")


@pytest.fixture(scope="module")
def hub_cache(qwen3_dir, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf-hub-cache")
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    shutil.copytree(qwen3_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def test_a_hub_id_in_the_cache_runs_offline_and_equals_hf(hub_cache):
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    snapshot = hub_cache / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / COMMIT
    assert Path(got["model"]) == snapshot and got["served"] == REPO_ID  # served under the id, as vLLM does
    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([got["prompt"]]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert got["tokens"] == out[0, len(got["prompt"]):].tolist()


def test_an_id_not_in_the_cache_says_how_to_get_it(hub_cache, monkeypatch):
    import huggingface_hub.constants

    from sparrow.config import ConfigError, EngineConfig
    from sparrow.engine.setup import finalize_config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    with pytest.raises(ConfigError, match=r"'model': 'sparrow-test/missing' does not exist, nor is it in the "
                                          r"Hugging Face cache; download it first \(for example `hf download "
                                          r"sparrow-test/missing`"):
        finalize_config(EngineConfig.from_kwargs(model="sparrow-test/missing"))
    # A relative path that does not exist is not taken for an id.
    with pytest.raises(ConfigError) as info:
        finalize_config(EngineConfig.from_kwargs(model="./no/such"))
    assert "Hugging Face cache;" not in str(info.value)
    # The tokenizer argument takes a cached id too.
    config = finalize_config(EngineConfig.from_kwargs(model=REPO_ID, tokenizer=REPO_ID))
    assert config.model.tokenizer == config.model.model != REPO_ID
    # So does a draft model.
    draft = EngineConfig.from_kwargs(speculative_config={"method": "draft_model", "model": REPO_ID,
                                                         "num_speculative_tokens": 2})
    assert draft.speculative.speculative_config["model"] == config.model.model


@pytest.fixture(scope="module")
def two_revisions(qwen3_dir, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A cache (not the default one) with two revisions of one id: main, and the tag v1 whose
    config.json says max_position_embeddings 96."""
    cache = tmp_path_factory.mktemp("hf-download-dir")
    repo = cache / "models--sparrow-test--revisions"
    commits = {"main": "1" * 40, "v1": "2" * 40}
    for ref, commit in commits.items():
        snapshot = repo / "snapshots" / commit
        shutil.copytree(qwen3_dir, snapshot)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    config_path = repo / "snapshots" / commits["v1"] / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 96
    config_path.write_text(json.dumps(config))
    return cache, {ref: repo / "snapshots" / commit for ref, commit in commits.items()}


def test_revision_tokenizer_revision_and_download_dir_choose_the_snapshot(two_revisions, qwen3_dir):
    from sparrow.config import ConfigError, EngineConfig
    from sparrow.engine.setup import finalize_config

    cache, snapshots = two_revisions
    repo_id = "sparrow-test/revisions"

    def finalized(**kwargs):
        return finalize_config(EngineConfig.from_kwargs(model=repo_id, download_dir=str(cache), **kwargs))

    main = finalized()
    assert Path(main.model.model) == snapshots["main"] and main.model.max_model_len != 96
    tagged = finalized(revision="v1")
    assert Path(tagged.model.model) == snapshots["v1"] and tagged.model.max_model_len == 96
    assert Path(tagged.model.tokenizer) == snapshots["v1"]  # the tokenizer follows the model's snapshot
    assert Path(finalized(revision=str(snapshots["v1"].name)).model.model) == snapshots["v1"]  # a commit
    assert Path(finalized(revision="v1", tokenizer_revision="main").model.tokenizer) == snapshots["main"]
    # Applied once: finalizing the finalized configuration again changes nothing.
    assert finalize_config(tagged).model.model == tagged.model.model
    with pytest.raises(ConfigError, match=r"'revision': 'sparrow-test/revisions' at revision 'v2' is not in the "
                                          r"Hugging Face cache .*hf download sparrow-test/revisions --revision v2"):
        finalized(revision="v2")
    # Refused, not ignored, where there is no Hub id to apply them to.
    for kwargs, field in (({"model": qwen3_dir, "revision": "v1"}, "revision"),
                          ({"model": qwen3_dir, "download_dir": str(cache)}, "download_dir"),
                          ({"revision": "v1"}, "revision"),
                          ({"tokenizer_revision": "v1"}, "tokenizer_revision"),
                          ({"model": qwen3_dir, "tokenizer_revision": "v1"}, "tokenizer_revision")):
        with pytest.raises(ConfigError, match=f"invalid engine argument '{field}'"):
            finalize_config(EngineConfig.from_kwargs(**kwargs))


def test_a_lora_adapter_by_hub_id_is_read_from_the_cache(qwen3_dir, tmp_path, monkeypatch):
    """LoRARequest("name", 1, "org/adapter"), as vLLM takes it: the adapter's snapshot in the
    Hugging Face cache, the same tokens as the adapter given by its directory."""
    import huggingface_hub.constants

    from sparrow import LLM, LoRARequest, SamplingParams
    from sparrow.tiny.lora import build_lora_adapter

    local = build_lora_adapter(qwen3_dir, tmp_path / "adapter", rank=4, seed=3)
    repo = tmp_path / "cache" / "models--sparrow-test--adapter"
    shutil.copytree(local, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(qwen3_dir, multiprocess=False, enable_lora=True, max_lora_rank=8, max_model_len=128, num_kv_blocks=32)
    try:
        by_id = llm.generate(["The sparrow"], params, lora_request=LoRARequest("by-id", 1, "sparrow-test/adapter"),
                             use_tqdm=False)
        by_dir = llm.generate(["The sparrow"], params, lora_request=LoRARequest("by-dir", 2, str(local)),
                              use_tqdm=False)
        base = llm.generate(["The sparrow"], params, use_tqdm=False)
        assert by_id[0].outputs[0].token_ids == by_dir[0].outputs[0].token_ids != base[0].outputs[0].token_ids
        with pytest.raises(ValueError, match="sparrow-test/missing"):
            llm.generate(["x"], params, lora_request=LoRARequest("missing", 3, "sparrow-test/missing"), use_tqdm=False)
    finally:
        llm.shutdown()
