"""The example plugin packages, pip-installed into this environment and used by a fresh interpreter.

Entry points are read once per process, so every generation runs in a subprocess; the test
process only installs, checks and uninstalls (always, in ``finally``). The packages are copied to a
temporary directory first so that the build leaves nothing in the repository.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sparrow.plugins import get_plugin_manager

# These tests pip-install the example plugins into this environment: other tests running at the
# same time would see their entry points, so `make test` runs them alone (the serial pass).
pytestmark = pytest.mark.serial

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROMPT_LENGTHS = (3, 20, 45)
MAX_TOKENS = 4

# Runs in the child: argv[1] is a JSON dict of arguments; the last stdout line is a JSON result.
GENERATE = textwrap.dedent("""
    import json, os, sys
    from sparrow import LLM, SamplingParams

    args = json.loads(sys.argv[1])
    results = {}
    for run in args["runs"]:
        os.environ.pop("SPARROW_TRACE_FILE", None)
        if run.get("trace_file"):
            os.environ["SPARROW_TRACE_FILE"] = run["trace_file"]
        try:
            llm = LLM(args["model"], multiprocess=run["multiprocess"], device=run["device"], dtype="float32",
                      max_model_len=256, num_kv_blocks=32, max_num_batched_tokens=32)
        except Exception as exc:
            results[run["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        try:
            prompts = [{"prompt_token_ids": ids} for ids in args["prompts"]]
            params = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, ignore_eos=True)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            result = {"tokens": [o.outputs[0].token_ids for o in outputs],
                      "request_ids": [o.request_id for o in outputs],
                      "block_size": llm.llm_engine.engine_core.call_utility("get_kv_cache_info")["block_size"]}
            if not run["multiprocess"]:
                result["attention"] = llm.collective_rpc("attention_backend_cls", args=(None,))[0].__name__
            results[run["name"]] = result
        finally:
            llm.shutdown()
    print(json.dumps(results))
""")


def prompts() -> list[list[int]]:
    return [[(13 * n + 7 * i) % 3000 + 1 for i in range(n)] for n in PROMPT_LENGTHS]


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("SPARROW_PLUGINS", "SPARROW_TRACE_FILE")}


def generate_in_child(model_dir: str, runs: list[dict]) -> dict:
    args = {"model": model_dir, "prompts": prompts(), "max_tokens": MAX_TOKENS, "runs": runs}
    proc = subprocess.run([sys.executable, "-c", GENERATE, json.dumps(args)], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def generate_here(model_dir: str) -> list[list[int]]:
    from sparrow import LLM, SamplingParams

    llm = LLM(model_dir, multiprocess=False, dtype="float32", max_model_len=256, num_kv_blocks=32,
              max_num_batched_tokens=32)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts()], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--no-input"],
                          capture_output=True, text=True, timeout=300)


def is_installed(dist_name: str) -> bool:
    """Whether this environment has the distribution, read as entry points are read: its
    metadata on sys.path (read afresh: importlib caches a directory only while it is unchanged)."""
    try:
        importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@contextlib.contextmanager
def pip_installed(package: str, dist_name: str, tmp_path: Path):
    source = tmp_path / package
    shutil.copytree(EXAMPLES / package, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    if is_installed(dist_name):  # left over from an interrupted run (each pip run costs CI seconds)
        pip("uninstall", "-y", dist_name)
    try:
        proc = pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(source))
        assert proc.returncode == 0, f"pip install {package} failed:\n{proc.stdout}\n{proc.stderr}"
        assert is_installed(dist_name), f"pip installed {dist_name} where this environment does not see it"
        yield
    finally:
        uninstalled = pip("uninstall", "-y", dist_name)
    assert uninstalled.returncode == 0, uninstalled.stderr
    assert not is_installed(dist_name), f"{dist_name} is still installed"


@pytest.fixture(autouse=True)
def _pin_this_process_plugins():
    # Load this process's plugin manager before anything is installed: it must never pick up the
    # example packages (other tests in this session share it).
    get_plugin_manager()


def sparrow_plugins_output() -> str:
    script = Path(sys.executable).with_name("sparrow")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "sparrow.entrypoints.cli"]
    proc = subprocess.run([*command, "plugins"], env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# -- an out-of-tree platform ------------------------------------------------------------------
def test_example_platform_installs_matches_cpu_and_uninstalls(qwen3_dir, tmp_path):
    runs = [dict(name="cpu", device="cpu", multiprocess=False),
            dict(name="cpu_sdpa", device="cpu_sdpa", multiprocess=False)]
    with pip_installed("sparrow_example_platform", "sparrow-example-platform", tmp_path):
        assert "cpu_sdpa (priority -10, present, from cpu_sdpa)" in sparrow_plugins_output()
        installed = generate_in_child(qwen3_dir, runs)
    cpu, sdpa = installed["cpu"], installed["cpu_sdpa"]
    assert "error" not in sdpa, sdpa
    # Its own platform (default block size 32), its own attention backend, the same greedy tokens.
    assert (cpu["block_size"], sdpa["block_size"]) == (16, 32)
    assert sdpa["attention"] == "GatherSdpaAttention" and cpu["attention"] != sdpa["attention"]
    assert sdpa["tokens"] == cpu["tokens"]
    assert [len(t) for t in sdpa["tokens"]] == [MAX_TOKENS] * len(PROMPT_LENGTHS)

    assert "cpu_sdpa" not in sparrow_plugins_output()
    after = generate_in_child(qwen3_dir, runs)
    assert after["cpu"]["tokens"] == cpu["tokens"], "the engine must work as before once the plugin is gone"
    error = after["cpu_sdpa"].get("error", "")
    match = re.search(r"unknown device 'cpu_sdpa'; installed platforms: (.*)", error)
    assert match, error
    installed_platforms = match.group(1).split(", ")
    assert "cpu" in installed_platforms and "cpu_sdpa" not in installed_platforms


# -- a model architecture ---------------------------------------------------------------------
def test_example_model_plugin_serves_its_architecture_equal_to_hf(tmp_path):
    from tests.conftest import build_test_model
    from tests.test_parity import hf_greedy

    # Granite: a Llama with four multipliers, none of them 1, so a plugin that ignored one differs.
    granite_dir = build_test_model(tmp_path / "granite", arch="granite", seed=7, num_key_value_heads=1)
    from sparrow.model_loader import get_hf_config
    from sparrow.models.registry import UnsupportedArchitectureError, resolve_model_class
    from sparrow.plugins import get_registry

    with pytest.raises(UnsupportedArchitectureError, match="GraniteForCausalLM"):  # not built in
        resolve_model_class(get_hf_config(granite_dir), get_registry().architectures)
    runs = [dict(name="engine_process", device="cpu", multiprocess=True)]
    with pip_installed("sparrow_example_model", "sparrow-example-model", tmp_path):
        assert re.search(r"^  granite: sparrow_register_model_architectures$", sparrow_plugins_output(), re.M)
        served = generate_in_child(granite_dir, runs)["engine_process"]
    assert "error" not in served, served
    reference = hf_greedy(granite_dir, prompts(), MAX_TOKENS)
    assert served["tokens"] == [tokens for tokens, _ in reference]


# -- an observer plugin -----------------------------------------------------------------------
def test_step_tracer_writes_one_line_per_step_and_changes_nothing(qwen3_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    runs = [dict(name="untraced", device="cpu", multiprocess=False),  # tracer installed, variable unset
            dict(name="traced", device="cpu", multiprocess=True, trace_file=str(trace))]
    baseline = generate_here(qwen3_dir)  # this process has no tracer (see _pin_this_process_plugins)
    with pip_installed("sparrow_step_tracer", "sparrow-step-tracer", tmp_path):
        assert re.search(r"^  step_tracer: sparrow_execute_model, sparrow_schedule$", sparrow_plugins_output(), re.M)
        results = generate_in_child(qwen3_dir, runs)
    assert results["untraced"]["tokens"] == baseline
    assert results["traced"]["tokens"] == baseline

    # Only the traced run wrote, from the engine-core process (multiprocess=True).
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines, "no trace written"
    assert [line["step"] for line in lines] == list(range(len(lines)))
    assert len({line["pid"] for line in lines}) == 1
    request_ids = set(results["traced"]["request_ids"])
    per_request: dict[str, int] = {}
    for line in lines:
        assert set(line) == {"step", "pid", "rank", "num_scheduled_tokens", "total_num_scheduled_tokens",
                             "schedule_s", "forward_s"}
        assert set(line["num_scheduled_tokens"]) <= request_ids
        assert sum(line["num_scheduled_tokens"].values()) == line["total_num_scheduled_tokens"] <= 32
        assert line["forward_s"] > 0 and line["schedule_s"] >= 0 and line["rank"] == 0
        for req_id, num_tokens in line["num_scheduled_tokens"].items():
            per_request[req_id] = per_request.get(req_id, 0) + num_tokens
    # One line per step: no step is missing or repeated, so each request's scheduled tokens add
    # up to its prompt plus every output token but the last (which is sampled, never fed back).
    by_id = dict(zip(results["traced"]["request_ids"], PROMPT_LENGTHS))
    assert per_request == {req_id: length + MAX_TOKENS - 1 for req_id, length in by_id.items()}
