"""The hook contract is versioned: the specs match a checked-in snapshot unless CONTRACT_VERSION
grew by the right amount, and the objects the hooks hand to plugins satisfy the typed seams
(``sparrow.interfaces``) the specs are annotated with."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

from sparrow import hookspecs, interfaces
from sparrow.config import EngineConfig

if TYPE_CHECKING:  # the edited hookspecs' annotations below, as the real ones name them
    from sparrow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from sparrow.core.request import Request
    from sparrow.core.sched.interface import SchedulerInterface
    from sparrow.core.sched.output import SchedulerOutput

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "hookspec_snapshot.py"
FAKE = "tests.fake_executor:FakeExecutor"


def load_script():
    spec = importlib.util.spec_from_file_location("hookspec_snapshot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


snapshot_tool = load_script()


def saved_snapshot() -> dict:
    return json.loads(snapshot_tool.SNAPSHOT.read_text(encoding="utf-8"))


def specs_module(version: str = hookspecs.CONTRACT_VERSION, drop: tuple[str, ...] = (), **new_specs):
    """A copy of sparrow.hookspecs at ``version``, without the hooks in ``drop`` and with
    ``new_specs`` (name -> hookspec function) added or replacing existing ones."""
    module = types.ModuleType("edited_hookspecs")
    module.__dict__.update({k: v for k, v in vars(hookspecs).items() if k not in drop})
    module.__dict__.update(new_specs)
    module.CONTRACT_VERSION = version
    return module


# Versions relative to the one the snapshot records, so the tests hold after every real bump.
_MAJOR, _MINOR, _PATCH = (int(part) for part in hookspecs.CONTRACT_VERSION.split("."))
CURRENT = hookspecs.CONTRACT_VERSION
PATCH = f"{_MAJOR}.{_MINOR}.{_PATCH + 1}"
MINOR = f"{_MAJOR}.{_MINOR + 1}.0"
MAJOR = f"{_MAJOR + 1}.0.0"


def errors_for(module) -> list[str]:
    return snapshot_tool.contract_errors(saved_snapshot(), snapshot_tool.build_snapshot(module))


# -- the snapshot -----------------------------------------------------------------------------
def test_hookspecs_match_the_snapshot():
    errors = snapshot_tool.contract_errors(saved_snapshot(), snapshot_tool.build_snapshot())
    assert not errors, "\n".join(errors)


def test_snapshot_records_every_hookspec_with_its_signature():
    snapshot = snapshot_tool.build_snapshot()
    assert snapshot["contract_version"] == hookspecs.CONTRACT_VERSION
    assert set(snapshot["hookspecs"]) == {name for name in dir(hookspecs) if name.startswith("sparrow_")}
    execute = snapshot["hookspecs"]["sparrow_execute_model"]
    assert execute["parameters"] == [{"name": "worker", "annotation": "Worker"},
                                     {"name": "scheduler_output", "annotation": "SchedulerOutput"}]
    assert execute["returns"] == "ModelRunnerOutput | None" and execute["firstresult"] is True
    assert snapshot["hookspecs"]["sparrow_register_platforms"]["firstresult"] is False


def test_the_script_writes_the_snapshot_the_test_reads(tmp_path):
    out = tmp_path / "snapshot.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--output", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == snapshot_tool.build_snapshot()
    check = subprocess.run([sys.executable, str(SCRIPT), "--check", "--output", str(out)], capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0, check.stderr


def test_the_script_refuses_to_record_a_change_without_its_bump(tmp_path):
    out = tmp_path / "snapshot.json"
    stale = snapshot_tool.build_snapshot()
    del stale["hookspecs"]["sparrow_schedule"]  # as if the current specs had just added it
    out.write_text(json.dumps(stale))
    for args in (["--check"], []):
        proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--output", str(out)], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 1
        assert "hookspec sparrow_schedule changed (added): bump CONTRACT_VERSION" in proc.stderr
    assert json.loads(out.read_text()) == stale
    forced = subprocess.run([sys.executable, str(SCRIPT), "--force", "--output", str(out)], capture_output=True,
                            text=True, timeout=120)
    assert forced.returncode == 0, forced.stderr
    assert json.loads(out.read_text()) == snapshot_tool.build_snapshot()


# -- how a change must be versioned -----------------------------------------------------------
# Edited copies of real hookspecs; their annotations are the originals' (postponed, so never
# evaluated), so that only the edit differs.
@hookspecs.hookspec
def sparrow_new_hook(engine_config: object) -> None:
    """A hook a later version adds."""


@hookspecs.hookspec(firstresult=True)
def sparrow_allocate_slots_renamed(kv_cache_manager: KVCacheManager, request: Request, num_tokens: int,
                                   num_new_computed_tokens: int,
                                   new_computed_blocks: KVCacheBlocks | None) -> KVCacheBlocks | None:
    """``num_new_tokens`` renamed."""


@hookspecs.hookspec
def sparrow_schedule_collecting(scheduler: SchedulerInterface) -> SchedulerOutput | None:
    """``sparrow_schedule`` without firstresult."""


@hookspecs.hookspec(firstresult=True)
def sparrow_schedule_with_budget(scheduler: SchedulerInterface, token_budget: int) -> SchedulerOutput | None:
    """``sparrow_schedule`` with an added argument."""


def test_an_added_hook_needs_a_minor_bump():
    errors = errors_for(specs_module(sparrow_new_hook=sparrow_new_hook))
    assert errors == ["hookspec sparrow_new_hook changed (added): bump CONTRACT_VERSION (minor for an added hook "
                      "or argument, major for a removed/renamed one or a changed meaning) and regenerate with "
                      "scripts/hookspec_snapshot.py"]
    patch = errors_for(specs_module(PATCH, sparrow_new_hook=sparrow_new_hook))
    assert len(patch) == 1 and "a minor change" in patch[0] and f"make it at least {MINOR}" in patch[0]
    # Bumped right: what is left is to record it.
    for version in (MINOR, MAJOR):
        (error,) = errors_for(specs_module(version, sparrow_new_hook=sparrow_new_hook))
        assert "regenerate the snapshot" in error and "sparrow_new_hook added" in error


def test_an_added_argument_needs_a_minor_bump():
    edited = {"sparrow_schedule": sparrow_schedule_with_budget}
    (error,) = errors_for(specs_module(**edited))
    assert error.startswith("hookspec sparrow_schedule changed (argument 'token_budget' added): bump CONTRACT_VERSION")
    assert "regenerate the snapshot" in errors_for(specs_module(MINOR, **edited))[0]


def test_a_removed_hook_with_only_a_minor_bump_fails():
    errors = errors_for(specs_module(MINOR, drop=("sparrow_schedule",)))
    assert errors == ["hookspec sparrow_schedule changed (removed), a major change, but CONTRACT_VERSION went from "
                      f"{CURRENT} to {MINOR}, a minor bump: make it {MAJOR}"]
    assert "bump CONTRACT_VERSION" in errors_for(specs_module(drop=("sparrow_schedule",)))[0]
    (error,) = errors_for(specs_module(MAJOR, drop=("sparrow_schedule",)))
    assert "regenerate the snapshot" in error


def test_a_renamed_argument_or_a_changed_flag_is_major():
    renamed = specs_module(MINOR, sparrow_allocate_slots=sparrow_allocate_slots_renamed)
    errors = errors_for(renamed)
    assert any("argument 'num_new_tokens' removed or renamed), a major change" in e for e in errors), errors
    flag = errors_for(specs_module(MINOR, sparrow_schedule=sparrow_schedule_collecting))
    assert len(flag) == 1 and "firstresult changed from True to False), a major change" in flag[0]


def test_the_version_never_goes_back_and_a_bare_bump_is_recorded():
    (back,) = errors_for(specs_module("0.9.0"))
    assert f"older than the snapshot's {CURRENT}" in back
    (bare,) = errors_for(specs_module(PATCH))  # a documentation-only release
    assert "regenerate the snapshot" in bare and "no hookspec change" in bare


# -- typed seams ------------------------------------------------------------------------------
def protocol_methods(protocol: type) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def protocol_members(protocol: type) -> set[str]:
    return set(vars(protocol).get("__annotations__", {})) | set(protocol_methods(protocol))


def assert_satisfies(obj: object, protocol: type) -> None:
    missing = sorted(name for name in protocol_members(protocol) if not hasattr(obj, name))
    assert not missing, f"{type(obj).__name__} lacks {missing} of {protocol.__name__}"
    assert isinstance(obj, protocol)
    for name, member in protocol_methods(protocol).items():
        if inspect.iscoroutinefunction(member):
            assert inspect.iscoroutinefunction(getattr(type(obj), name)), f"{type(obj).__name__}.{name} must be async"


def test_interfaces_import_without_torch():
    code = "import sys, sparrow.interfaces, sparrow.hookspecs; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr


def test_builtin_platforms_satisfy_the_platform_protocol():
    from sparrow.platforms.interface import Platform as PlatformBase
    from sparrow_cpu.platform import CpuPlatform
    from sparrow_cuda.platform import CudaPlatform

    for platform in (CpuPlatform(), CudaPlatform(), PlatformBase()):
        assert_satisfies(platform, interfaces.Platform)
    assert not isinstance(object(), interfaces.Platform)


def test_builtin_worker_and_model_runner_satisfy_their_protocols(qwen3_dir):
    from sparrow import LLM
    from sparrow_cuda.worker import CudaWorker

    llm = LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=256, num_kv_blocks=16)
    try:
        client = llm.llm_engine.engine_core
        assert_satisfies(client, interfaces.EngineCoreClient)
        worker = client.engine_core.executor.worker
        assert_satisfies(worker, interfaces.Worker)
        assert_satisfies(worker.model_runner, interfaces.ModelRunner)
        assert_satisfies(worker.platform, interfaces.Platform)
    finally:
        llm.shutdown()
    # The CUDA worker (checked on the class: this machine may have no GPU) adds device methods
    # to the same base, which sets the data attributes in its constructor.
    from sparrow.worker.worker_base import WorkerBase

    assert issubclass(CudaWorker, WorkerBase) and isinstance(worker, WorkerBase)
    for name in protocol_methods(interfaces.Worker):
        assert callable(getattr(CudaWorker, name)), name


def test_engine_core_clients_satisfy_their_protocols():
    from sparrow.engine.dp_client import AsyncDPClient, DPClient
    from sparrow.engine.mp_client import AsyncMPClient, SyncMPClient

    config = EngineConfig.from_kwargs(max_model_len=1024)
    sync_client = SyncMPClient(config, executor_factory=FAKE)
    try:
        assert_satisfies(sync_client, interfaces.EngineCoreClient)
        assert not isinstance(sync_client, interfaces.AsyncEngineCoreClient)
    finally:
        sync_client.shutdown()

    async def check_async() -> None:
        client = AsyncMPClient(config, executor_factory=FAKE)
        try:
            assert_satisfies(client, interfaces.AsyncEngineCoreClient)
            info = await client.call_utility_async("get_kv_cache_info")
            assert {key: info[key] for key in ("num_blocks", "block_size")} == {
                key: client.kv_cache_info[key] for key in ("num_blocks", "block_size")}
        finally:
            client.shutdown()

    asyncio.run(check_async())
    # The data-parallel clients stand in for the same protocols (checked on the class: an
    # instance starts one engine process per rank).
    for cls, protocol in ((DPClient, interfaces.EngineCoreClient), (AsyncDPClient, interfaces.AsyncEngineCoreClient)):
        for name, member in protocol_methods(protocol).items():
            assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
            if inspect.iscoroutinefunction(member):
                assert inspect.iscoroutinefunction(getattr(cls, name)), f"{cls.__name__}.{name} must be async"
