"""Entry-point discovery as a user meets it: broken plugins, the allow-list, `sparrow plugins`.

Each case puts a throwaway distribution (a ``*.dist-info`` directory with an ``entry_points.txt``
and its module) in a temporary directory on ``PYTHONPATH`` of a fresh interpreter: entry points are
read once per process, and the test process's own plugin manager stays untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BUILTIN_ENTRY_POINTS = ("schedulers", "cpu", "cuda")

LOAD_PLUGINS = textwrap.dedent("""
    import json
    from sparrow.plugins import PluginError, get_plugin_manager, get_registry
    try:
        pm = get_plugin_manager()
    except PluginError as exc:
        print(json.dumps({"error": str(exc)}))
    else:
        print(json.dumps({"plugins": [name for name, _ in pm.list_name_plugin()],
                          "platforms": sorted(get_registry(pm).platforms)}))
""")


def make_distribution(root: Path, dist_name: str, entry_point: str, module_name: str, source: str) -> None:
    """Install-free: a module plus the dist-info metadata importlib.metadata reads."""
    (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    dist_info = root / f"{dist_name.replace('-', '_')}-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[sparrow]\n{entry_point} = {module_name}\n")


def child_env(path: Path, allow: str | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("SPARROW_PLUGINS", "SPARROW_TRACE_FILE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    if allow is not None:
        env["SPARROW_PLUGINS"] = allow
    return env


def load_in_child(path: Path, allow: str | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", LOAD_PLUGINS], env=child_env(path, allow), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sparrow_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("sparrow")  # the console script of this environment
    command = [str(script)] if script.exists() else [sys.executable, "-m", "sparrow.entrypoints.cli"]
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=120)


BROKEN = """
    raise RuntimeError("vendor runtime libnpu.so not found")
"""

MISSPELLED = """
    from sparrow.hookspecs import hookimpl

    @hookimpl
    def sparrow_schedul(scheduler):  # sparrow_schedule, misspelled
        return None
"""

THIRD_PARTY = """
    from sparrow.hookspecs import hookimpl
    from sparrow_schedulers import FCFSScheduler


    class NewestFirst(FCFSScheduler):
        sort_waiting = True

        def waiting_key(self, request):
            return -request.arrival_time


    class NullStore:
        pass


    @hookimpl
    def sparrow_register_platforms(register):
        register("toydev", lambda: None, priority=3)  # its device is never present


    @hookimpl
    def sparrow_register_schedulers(register):
        register("newest-first", NewestFirst)


    @hookimpl
    def sparrow_register_kv_connectors(register):
        register("null-store", NullStore)


    @hookimpl
    def sparrow_register_model_architectures(register):
        register("ToyForCausalLM", "toy_models.model:ToyForCausalLM")
"""


# -- a plugin that raises while loading -------------------------------------------------------
def test_plugin_raising_on_load_is_a_plugin_error_naming_it(tmp_path):
    make_distribution(tmp_path, "sparrow-broken-vendor", "broken_vendor", "broken_vendor_plugin", BROKEN)
    result = load_in_child(tmp_path)
    message = result.get("error", "")
    assert "sparrow plugin 'broken_vendor' (broken_vendor_plugin) failed to load" in message
    assert "libnpu.so not found" in message
    assert "SPARROW_PLUGINS" in message  # and it says how to get past it


def test_sparrow_plugins_allow_list_excludes_the_broken_plugin(tmp_path):
    make_distribution(tmp_path, "sparrow-broken-vendor", "broken_vendor", "broken_vendor_plugin", BROKEN)
    result = load_in_child(tmp_path, allow=",".join(BUILTIN_ENTRY_POINTS))
    assert "error" not in result, result
    assert "broken_vendor" not in result["plugins"]
    assert set(BUILTIN_ENTRY_POINTS) <= set(result["plugins"])
    assert "cpu" in result["platforms"]


def test_allow_list_also_drops_builtin_plugins(tmp_path):
    result = load_in_child(tmp_path, allow="schedulers")
    assert "cpu" not in result["plugins"] and "cpu" not in result["platforms"]
    assert "schedulers" in result["plugins"]


def test_broken_plugin_fails_the_cli_with_its_name(tmp_path):
    make_distribution(tmp_path, "sparrow-broken-vendor", "broken_vendor", "broken_vendor_plugin", BROKEN)
    proc = sparrow_cli("plugins", env=child_env(tmp_path))
    assert proc.returncode != 0
    # One line naming the plugin and its failure; the traceback only behind --debug.
    assert proc.stderr.startswith("sparrow: error:") and "'broken_vendor'" in proc.stderr, proc.stderr
    assert "libnpu.so" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# -- a misspelled hook ------------------------------------------------------------------------
def test_misspelled_hook_in_an_installed_plugin_is_an_error_naming_it(tmp_path):
    make_distribution(tmp_path, "sparrow-typo", "typo_plugin", "typo_plugin_module", MISSPELLED)
    message = load_in_child(tmp_path).get("error", "")
    assert "sparrow plugin 'typo_plugin' is invalid" in message
    assert "sparrow_schedul" in message
    assert "error" not in load_in_child(tmp_path, allow=",".join(BUILTIN_ENTRY_POINTS))


# -- `sparrow plugins` ------------------------------------------------------------------------
def parse_plugins_output(text: str) -> dict[str, list[str] | str]:
    """Section -> its indented lines (plugins, platforms) or its one-line value."""
    sections: dict[str, list[str] | str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  ") and current is not None:
            sections[current].append(line.strip())  # type: ignore[union-attr]
            continue
        name, _, value = line.partition(":")
        current = name.strip()
        sections[current] = value.strip() if value.strip() else []
    return sections


@pytest.fixture(scope="module")
def plugins_listing(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("third-party")
    make_distribution(root, "sparrow-toy", "toy", "toy_sparrow_plugin", THIRD_PARTY)
    proc = sparrow_cli("plugins", env=child_env(root))
    assert proc.returncode == 0, proc.stderr
    return parse_plugins_output(proc.stdout)


def test_cli_lists_every_plugin_with_its_hooks(plugins_listing):
    plugins = dict(line.split(": ", 1) for line in plugins_listing["plugins"])
    assert plugins["schedulers"] == "sparrow_register_schedulers, sparrow_schedule"
    assert plugins["cpu"] == "sparrow_attention_backend, sparrow_execute_model, sparrow_register_platforms"
    assert "sparrow_register_platforms" in plugins["cuda"]
    assert plugins["toy"] == ("sparrow_register_kv_connectors, sparrow_register_model_architectures, "
                              "sparrow_register_platforms, sparrow_register_schedulers")
    # the kernel's own implementations are listed too
    assert plugins["sparrow.core.default_hooks"] == "sparrow_allocate_slots"


def test_cli_lists_platforms_with_priority_presence_and_owner(plugins_listing):
    platforms = plugins_listing["platforms"]
    assert "cpu (priority 0, present, from cpu)" in platforms
    assert "toydev (priority 3, absent, from toy)" in platforms
    assert any(line.startswith("cuda (priority 10, ") for line in platforms)


def test_cli_lists_schedulers_connectors_and_architectures(plugins_listing):
    schedulers = plugins_listing["schedulers"].split(", ")
    assert {"fcfs", "priority", "sjf", "lpm", "newest-first"} <= set(schedulers)
    assert "null-store" in plugins_listing["kv connectors"].split(", ")
    architectures = plugins_listing["architectures"].split(", ")
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "ToyForCausalLM"} <= set(architectures)
