"""Plugins written by a third party from docs/plugins.md alone, installed out of tree.

Each test builds a small package in ``tmp_path``, installs it with ``pip --target`` into a
directory of its own (never into this environment, so other tests never see it) and uses it
from a fresh interpreter with that directory on ``PYTHONPATH``: entry points are read once per
process. Covered: the documentation's own examples (quantization method, eviction policy,
speculative proposer) run as written; registration hooks run once per process; an override wins
whichever plugin loads first; a broken plugin fails with an error naming it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.test_out_of_tree_plugins import child_env, pip

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
BUILT_IN = "cpu,schedulers"  # the entry points a test's SPARROW_PLUGINS keeps besides its own

PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1"
dependencies = ["sparrow-llm"]

[project.entry-points.sparrow]
{name} = "{name}"
"""


def doc_example(marker: str) -> str:
    """The python block of docs/plugins.md that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"{len(found)} python blocks of docs/plugins.md contain {marker!r}"
    return found[0]


def install(tmp_path: Path, name: str, source: str) -> Path:
    """Build package ``name`` (one module, ``source``) and pip-install it into its own directory."""
    package = tmp_path / name
    (package / name).mkdir(parents=True)
    (package / "pyproject.toml").write_text(PYPROJECT.format(name=name))
    (package / name / "__init__.py").write_text('SPARROW_CONTRACT = ">=1.0,<2"\n' + textwrap.dedent(source))
    site = tmp_path / f"site-{name}"
    proc = pip("install", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(site), str(package))
    assert proc.returncode == 0, f"pip install {name} failed:\n{proc.stdout}\n{proc.stderr}"
    return site


def run_child(site: Path, plugin: str, script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter that sees the built-in plugins and ``plugin`` only."""
    env = {**child_env(), "PYTHONPATH": str(site), "SPARROW_PLUGINS": f"{BUILT_IN},{plugin}"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env, capture_output=True,
                          text=True, timeout=300)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"child failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


GENERATE = """
    import json, sys
    from sparrow import LLM, SamplingParams

    def generate(**engine_args):
        llm = LLM(sys.argv[1], multiprocess=False, dtype="float32", max_model_len=256, **engine_args)
        try:  # twice: the second pass hits the prefix cache
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            prefix = "a shared system prompt that fills more than one block of the cache " * 2
            prompts = [prefix + "Hello there, how are", prefix + "one two three four five six"]
            return [o.outputs[0].token_ids for _ in range(2) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
"""


def test_documented_examples_run_as_plugins(qwen3_dir, tmp_path):
    # The quantization, eviction and speculative-decoding examples, copied from the docs.
    source = "\n".join([doc_example("class MyInt8(QuantizationMethod)"), doc_example("class ProtectReused("),
                        doc_example("class RepeatLast(SpecProposer)")])
    source += textwrap.dedent("""
        CALLS = {"linear": 0, "on_hit": 0}
        _linear, _on_hit = Int8Linear.__call__, ProtectReused.on_hit

        def _count(name, function):
            def counted(self, *args):
                CALLS[name] += 1
                return function(self, *args)
            return counted

        Int8Linear.__call__ = _count("linear", _linear)
        ProtectReused.on_hit = _count("on_hit", _on_hit)
    """)
    site = install(tmp_path, "doc_examples", source)
    script = GENERATE + """
    import doc_examples
    plain = generate()
    result = {"plain": plain, "quantized": generate(quantization="my_int8"),
              "evicting": generate(kv_eviction_policy="protect_reused", num_kv_blocks=8, block_size=16),
              "speculating": generate(speculative_config={"method": "repeat_last", "num_speculative_tokens": 3}),
              "calls": doc_examples.CALLS}
    print(json.dumps(result))
    """
    result = last_json(run_child(site, "doc_examples", script, qwen3_dir))
    assert [len(tokens) for tokens in result["quantized"]] == [6] * 4
    assert result["calls"]["linear"] > 0, "the quantization method's linear op never ran"
    assert result["calls"]["on_hit"] > 0, "the eviction policy never saw a prefix-cache hit"
    # Eviction order and verified drafts never change greedy tokens.
    assert result["evicting"] == result["plain"]
    assert result["speculating"] == result["plain"]


def test_registration_hooks_run_once_and_an_override_wins_in_any_load_order(qwen3_dir, tmp_path):
    # The plugin's directory is first on sys.path, so its entry point loads before the built-in
    # `schedulers`, which registers `fcfs` without override.
    calls = tmp_path / "calls.txt"
    site = install(tmp_path, "fcfs_override", f"""
        from sparrow.hookspecs import hookimpl
        from sparrow_schedulers import FCFSScheduler

        ADMITTED = []


        class CountingFcfs(FCFSScheduler):
            sort_waiting = True  # so that every admission asks waiting_key

            def waiting_key(self, request):
                ADMITTED.append(request.request_id)
                return super().waiting_key(request)


        @hookimpl
        def sparrow_register_schedulers(register):
            with open({str(calls)!r}, "a") as out:
                out.write("called\\n")
            register("fcfs", CountingFcfs, override=True)
    """)
    script = GENERATE + """
    import fcfs_override
    from sparrow.plugins import get_registry
    tokens = generate(scheduler="fcfs")
    print(json.dumps({"cls": get_registry().schedulers["fcfs"].__name__, "admitted": len(fcfs_override.ADMITTED),
                      "tokens": tokens}))
    """
    result = last_json(run_child(site, "fcfs_override", script, qwen3_dir))
    assert result["cls"] == "CountingFcfs"
    assert result["admitted"] >= 2 and [len(t) for t in result["tokens"]] == [6] * 4
    assert calls.read_text().splitlines() == ["called"], "the registration hook must run once per process"


def test_broken_registrations_fail_naming_the_plugin(tmp_path):
    site = install(tmp_path, "broken_plugin", """
        import os
        from sparrow.hookspecs import hookimpl


        @hookimpl
        def sparrow_register_schedulers(register):
            if os.environ.get("BROKEN") == "raise":
                raise RuntimeError("no licence server")
            if os.environ.get("BROKEN") == "not_a_class":
                register("not-a-class", 42)


        @hookimpl
        def sparrow_register_kv_eviction_policies(register):
            register("missing", "broken_plugin.nowhere:Policy")


        @hookimpl
        def sparrow_register_quantization_methods(register):
            if os.environ.get("BROKEN") == "duplicate":
                register("int8", "broken_plugin:Int8")
    """)
    script = """
    import json, os, sys
    from sparrow.plugins import get_registry
    errors = {}
    for mode in ("raise", "not_a_class", "duplicate", ""):
        os.environ["BROKEN"] = mode
        try:
            get_registry()
            if mode == "":
                from sparrow.engine.core import eviction_policy_class
                eviction_policy_class("missing")
            errors[mode] = None
        except Exception as exc:
            errors[mode] = f"{type(exc).__name__}: {exc}"
        import sparrow.plugins
        sparrow.plugins._REGISTRIES.clear()  # the next mode's hooks run afresh
    print(json.dumps(errors))
    """
    errors = last_json(run_child(site, "broken_plugin", script))
    assert errors["raise"].startswith("PluginError: sparrow plugin 'broken_plugin' failed in "
                                      "sparrow_register_schedulers: RuntimeError('no licence server')")
    assert errors["not_a_class"].startswith("PluginError: sparrow plugin 'broken_plugin' registered scheduler "
                                            "'not-a-class' wrongly: 42 is not a class")
    assert "quantization method 'int8' is registered by both" in errors["duplicate"]
    assert "'broken_plugin'" in errors["duplicate"] and "override=True" in errors["duplicate"]
    assert errors[""].startswith("PluginError: kv_eviction_policy 'missing' is registered as "
                                 "'broken_plugin.nowhere:Policy', which does not import")
