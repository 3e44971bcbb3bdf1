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
import types
from pathlib import Path

import pytest

from sparrow.hookspecs import CONTRACT_VERSION
from sparrow.plugins import PluginError, check_contract, declared_contract, suggested_contract_range

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


def load_in_child(path: Path, allow: str | None = None, with_stderr: bool = False) -> dict:
    proc = subprocess.run([sys.executable, "-c", LOAD_PLUGINS], env=child_env(path, allow), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if with_stderr:
        result["stderr"] = proc.stderr
    return result


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


# -- the hook contract's version --------------------------------------------------------------
def declaring(contract: str) -> str:
    return f"""
    from sparrow.hookspecs import hookimpl

    SPARROW_CONTRACT = {contract!r}

    @hookimpl
    def sparrow_register_platforms(register):
        register("vendordev", lambda: None)
    """


def test_plugin_with_an_incompatible_contract_range_is_refused_naming_it(tmp_path):
    make_distribution(tmp_path, "sparrow-future-vendor", "future_vendor", "future_vendor_plugin",
                      declaring(">=2.0,<3"))
    message = load_in_child(tmp_path).get("error", "")
    assert message.startswith("sparrow plugin 'future_vendor' supports hook contract '>=2.0,<3', "
                              f"but the installed Sparrow's contract is {CONTRACT_VERSION}"), message
    assert "SPARROW_PLUGINS" in message  # and how to get past it
    # Refused before registration: excluding it leaves a working engine.
    assert "error" not in load_in_child(tmp_path, allow=",".join(BUILTIN_ENTRY_POINTS))


def test_plugin_with_a_compatible_contract_range_loads_without_warning(tmp_path):
    make_distribution(tmp_path, "sparrow-vendor", "vendor", "vendor_plugin", declaring(suggested_contract_range()))
    result = load_in_child(tmp_path, with_stderr=True)
    assert "error" not in result, result
    assert "vendor" in result["plugins"] and "vendordev" in result["platforms"]
    assert "SPARROW_CONTRACT" not in result["stderr"], result["stderr"]


def test_plugin_without_a_contract_range_loads_with_a_warning_saying_how_to_declare_it(tmp_path):
    make_distribution(tmp_path, "sparrow-toy", "toy", "toy_sparrow_plugin", THIRD_PARTY)
    result = load_in_child(tmp_path, with_stderr=True)
    assert "toy" in result["plugins"] and "toydev" in result["platforms"]
    warnings = [line for line in result["stderr"].splitlines() if "does not declare" in line]
    assert len(warnings) == 1, result["stderr"]  # once, and for this plugin only: the built-ins declare theirs
    assert "'toy'" in warnings[0] and f"SPARROW_CONTRACT = '{suggested_contract_range()}'" in warnings[0]


def test_plugin_with_a_malformed_contract_range_is_refused(tmp_path):
    make_distribution(tmp_path, "sparrow-sloppy", "sloppy", "sloppy_plugin", declaring("version one"))
    message = load_in_child(tmp_path).get("error", "")
    assert "sparrow plugin 'sloppy' declares SPARROW_CONTRACT = 'version one'" in message
    assert "PEP 440" in message


def test_contract_declared_on_the_module_of_an_entry_point_object():
    module = types.ModuleType("vendor_module")
    module.SPARROW_CONTRACT = ">=1.0,<2"

    class Plugin:
        pass

    Plugin.__module__ = module.__name__
    sys.modules[module.__name__] = module
    try:
        assert declared_contract(Plugin()) == ">=1.0,<2"  # the step tracer's shape: an instance
        check_contract(Plugin(), "vendor")
        module.SPARROW_CONTRACT = ">=0.1,<1"
        with pytest.raises(PluginError, match="'vendor' supports hook contract '>=0.1,<1'"):
            check_contract(Plugin(), "vendor")
    finally:
        del sys.modules[module.__name__]


def test_builtin_plugins_declare_a_range_that_holds_this_contract():
    from importlib.metadata import entry_points

    from packaging.specifiers import SpecifierSet

    declared = {ep.name: declared_contract(ep.load()) for ep in entry_points(group="sparrow")
                if ep.name in BUILTIN_ENTRY_POINTS}
    assert set(declared) == set(BUILTIN_ENTRY_POINTS)
    for name, contract in declared.items():
        assert contract is not None and CONTRACT_VERSION in SpecifierSet(contract), (name, contract)


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
    assert plugins["schedulers"] == "sparrow_register_schedulers"
    # A platform implements no step hook: the kernel's default runs its worker.
    assert {"sparrow_attention_backend", "sparrow_register_platforms"} <= set(plugins["cpu"].split(", "))
    assert "sparrow_execute_model" not in plugins["cpu"] and "sparrow_execute_model" not in plugins["cuda"]
    assert "sparrow_register_platforms" in plugins["cuda"]
    assert plugins["toy"] == ("sparrow_register_kv_connectors, sparrow_register_model_architectures, "
                              "sparrow_register_platforms, sparrow_register_schedulers")
    # the kernel's own implementations are listed too
    assert plugins["sparrow.core.default_hooks"] == "sparrow_allocate_slots, sparrow_execute_model, sparrow_schedule"


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
