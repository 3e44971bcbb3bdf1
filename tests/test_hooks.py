"""Every hook has a test of its own here, and the plugin docs name every hook with its signature."""

from __future__ import annotations

import contextlib
import inspect
import pathlib
import re

import pytest

from sparrow import hookspecs
from sparrow.config import EngineConfig
from sparrow.engine.core import EngineCore
from sparrow.hookspecs import hookimpl
from sparrow.platforms import resolve_platform
from sparrow.platforms.interface import Platform
from sparrow.plugins import PluginError, get_plugin_manager, get_registry, register_plugin
from tests.fake_executor import FakeExecutor
from tests.test_scheduler import make_request, run_to_completion

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOOK_NAMES = sorted(name for name in dir(hookspecs) if name.startswith("sparrow_"))


@contextlib.contextmanager
def registered(plugin, name: str):
    pm = get_plugin_manager()
    register_plugin(pm, plugin, name)
    try:
        yield pm
    finally:
        pm.unregister(name=name)


def engine_with(executor="fake", **kwargs) -> EngineCore:
    """An engine core on the fake executor, or with ``executor=None`` the platform's own."""
    kwargs.setdefault("max_model_len", 2048)
    return EngineCore(EngineConfig.from_kwargs(**kwargs), executor=FakeExecutor() if executor == "fake" else executor)


# -- documentation and coverage ---------------------------------------------------------------
def hook_signature(name: str) -> str:
    params = inspect.signature(getattr(hookspecs, name)).parameters
    return f"{name}({', '.join(params)})"


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_is_documented_with_its_signature(name):
    docs = (ROOT / "docs" / "plugins.md").read_text()
    assert re.search(rf"^#+ `?{name}`?", docs, re.M), f"docs/plugins.md has no section for {name}"
    assert hook_signature(name) in docs, f"docs/plugins.md lacks the signature {hook_signature(name)}"


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_has_a_test_of_its_own(name):
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    assert f"def test_{name}" in tests, f"no test named test_{name}*"


def test_every_hookspec_has_the_docstring_template():
    for name in HOOK_NAMES:
        doc = getattr(hookspecs, name).__doc__ or ""
        for part in ("When:", "Args:", "Returns:", "Semantics:"):
            assert part in doc, f"{name} docstring lacks {part!r}"


# -- registration hooks -----------------------------------------------------------------------
class TinyPlatform(Platform):
    name = "tinydev"
    worker_cls = "tests.fake_worker:FakeWorker"


class TinyPlatformPlugin:
    """A platform needs no step hook: the kernel's default runs its worker's execute_model."""

    @hookimpl
    def sparrow_register_platforms(self, register):
        register("tinydev", lambda: "tests.test_hooks:TinyPlatform", priority=-5)


def test_sparrow_register_platforms():
    with registered(TinyPlatformPlugin(), "tiny-platform"):
        assert "tinydev" in get_registry().platforms
        assert isinstance(resolve_platform("tinydev"), TinyPlatform)
        assert resolve_platform("auto").name == "cpu"  # higher priority wins
    with pytest.raises(ValueError, match="unknown device 'tinydev'; installed platforms: .*cpu"):
        resolve_platform("tinydev")


def test_sparrow_register_schedulers():
    from sparrow_schedulers import FCFSScheduler

    class NewestFirst(FCFSScheduler):
        sort_waiting = True

        def waiting_key(self, request):
            return -request.arrival_time

    class Plugin:
        @hookimpl
        def sparrow_register_schedulers(self, register):
            register("newest-first", NewestFirst)

    with registered(Plugin(), "newest-first-plugin"):
        executor = FakeExecutor()
        engine = engine_with(executor, scheduler="newest-first", max_num_seqs=1)
        for i in range(3):
            engine.add_request(make_request(f"r{i}", 4, max_tokens=1, arrival_time=float(i + 1)))
        run_to_completion(engine)
        order = [new.req_id for so in executor.history for new in so.scheduled_new_reqs]
        assert order == ["r2", "r1", "r0"]


def test_scheduler_name_clash_names_both_plugins():
    class Clash:
        @hookimpl
        def sparrow_register_schedulers(self, register):
            register("fcfs", object)

    with registered(Clash(), "clashing-plugin"):
        with pytest.raises(PluginError, match="'fcfs' is registered by both .*clashing-plugin"):
            get_registry()


def test_sparrow_register_kv_connectors():
    class Connector:
        pass

    class Plugin:
        @hookimpl
        def sparrow_register_kv_connectors(self, register):
            register("null-connector", Connector)

    with registered(Plugin(), "null-connector-plugin"):
        assert get_registry().kv_connectors["null-connector"] is Connector
    assert "null-connector" not in get_registry().kv_connectors


def test_sparrow_register_model_architectures():
    class Plugin:
        @hookimpl
        def sparrow_register_model_architectures(self, register):
            register("ToyForCausalLM", "toy_package.model:ToyForCausalLM")

    with registered(Plugin(), "toy-arch"):
        architectures = get_registry().architectures
        assert architectures["ToyForCausalLM"] == "toy_package.model:ToyForCausalLM"


def test_misspelled_hook_is_an_error_naming_the_plugin():
    class Typo:
        @hookimpl
        def sparrow_schedul(self, scheduler):
            return None

    with pytest.raises(PluginError, match="'typo-plugin'.*sparrow_schedul"):
        register_plugin(get_plugin_manager(), Typo(), "typo-plugin")
    assert get_plugin_manager().get_plugin("typo-plugin") is None


# -- core decision hooks ----------------------------------------------------------------------
def test_sparrow_schedule():
    seen: list[int] = []

    class Observer:
        @hookimpl(wrapper=True)
        def sparrow_schedule(self, scheduler):
            output = yield
            seen.append(output.total_num_scheduled_tokens)
            return output

    with registered(Observer(), "schedule-observer"):
        engine = engine_with(max_num_batched_tokens=32)
        engine.add_request(make_request("a", 40, max_tokens=2))
        run_to_completion(engine)
    assert seen == [32, 8, 1]


def test_sparrow_schedule_can_be_replaced():
    class Idle:
        @hookimpl(tryfirst=True)
        def sparrow_schedule(self, scheduler):
            from sparrow.core.sched.output import SchedulerOutput

            return SchedulerOutput()  # decide to run nothing

    with registered(Idle(), "idle-scheduler"):
        executor = FakeExecutor()
        engine = engine_with(executor)
        engine.add_request(make_request("a", 4))
        engine.step()
        assert executor.history == [] and engine.has_unfinished_requests()


def test_sparrow_schedule_and_allocate_slots_results_of_the_wrong_type_name_the_plugin():
    # A plugin returning the wrong thing fails at the hook, naming it, not as an AttributeError
    # deep in the kernel.
    from sparrow.plugins import PluginError

    class Sloppy:
        @hookimpl(tryfirst=True)
        def sparrow_schedule(self, scheduler):
            return {"num_scheduled_tokens": {}}

    with registered(Sloppy(), "sloppy-scheduler"):
        engine = engine_with()
        engine.add_request(make_request("a", 4))
        with pytest.raises(PluginError, match=r"sparrow_schedule returned dict .*not SchedulerOutput or None; "
                                              r"its implementations: .*sloppy-scheduler"):
            engine.step()

    class Careless:
        @hookimpl(wrapper=True)
        def sparrow_allocate_slots(self, request):
            yield
            return "plenty"

    with registered(Careless(), "careless-allocator"):
        engine = engine_with()
        engine.add_request(make_request("a", 4))
        with pytest.raises(PluginError, match=r"sparrow_allocate_slots returned str 'plenty', not KVCacheBlocks or "
                                              r"None; its implementations: .*careless-allocator"):
            engine.step()


def test_sparrow_allocate_slots():
    class Veto:
        """Refuses memory to one request: it waits while the others run."""

        @hookimpl(wrapper=True)
        def sparrow_allocate_slots(self, request):
            blocks = yield
            return None if request.request_id == "starved" else blocks

    with registered(Veto(), "veto"):
        executor = FakeExecutor()
        engine = engine_with(executor)
        engine.add_request(make_request("starved", 4, max_tokens=2))
        engine.add_request(make_request("fed", 4, max_tokens=2, start=40))
        for _ in range(5):
            engine.step()
        scheduled = {rid for so in executor.history for rid in so.num_scheduled_tokens}
        assert scheduled == set()  # the starved head of the FCFS queue blocks admission
        engine.abort_requests(["starved"])
        run_to_completion(engine)
        assert {rid for so in executor.history for rid in so.num_scheduled_tokens} == {"fed"}


def test_sparrow_execute_model():
    timings: list[int] = []

    class Timer:
        @hookimpl(wrapper=True)
        def sparrow_execute_model(self, worker, scheduler_output):
            output = yield
            timings.append(len(output.req_ids))
            return output

    with registered(TinyPlatformPlugin(), "tiny-platform"), registered(Timer(), "timer"):
        engine = engine_with(executor=None, device="tinydev")
        engine.add_request(make_request("a", 6, max_tokens=3))
        outputs = run_to_completion(engine)
    assert len(outputs["a"]) == 3
    assert timings == [1, 1, 1]


def test_sparrow_execute_model_result_of_the_wrong_type_names_the_plugin():
    from sparrow.plugins import PluginError

    class Broken:
        @hookimpl(tryfirst=True)
        def sparrow_execute_model(self, worker, scheduler_output):
            return 42

    with registered(TinyPlatformPlugin(), "tiny-platform"), registered(Broken(), "broken-runner"):
        engine = engine_with(executor=None, device="tinydev")
        engine.add_request(make_request("a", 6, max_tokens=3))
        with pytest.raises(PluginError, match=r"sparrow_execute_model returned int 42, not ModelRunnerOutput; "
                                              r"its implementations: .*broken-runner"):
            run_to_completion(engine)
        engine.shutdown()


def test_sparrow_execute_model_can_be_replaced_and_falls_through_on_none():
    replaced: list[int] = []
    declined: list[int] = []

    class Replacement:
        """Runs the step itself for tinydev workers (and records it); None for any other."""

        @hookimpl(tryfirst=True)
        def sparrow_execute_model(self, worker, scheduler_output):
            if worker.platform.name != "tinydev":
                return None
            replaced.append(scheduler_output.total_num_scheduled_tokens)
            return worker.execute_model(scheduler_output)

    class Bystander:
        @hookimpl(tryfirst=True)
        def sparrow_execute_model(self, worker):
            declined.append(1)
            return None  # not its worker: the next implementation (the kernel's default) answers

    with registered(TinyPlatformPlugin(), "tiny-platform"), registered(Replacement(), "replacement"):
        engine = engine_with(executor=None, device="tinydev")
        engine.add_request(make_request("a", 6, max_tokens=2))
        assert len(run_to_completion(engine)["a"]) == 2
    assert replaced == [6, 1]
    with registered(TinyPlatformPlugin(), "tiny-platform"), registered(Bystander(), "bystander"):
        engine = engine_with(executor=None, device="tinydev")
        engine.add_request(make_request("a", 6, max_tokens=2))
        assert len(run_to_completion(engine)["a"]) == 2
    assert declined == [1, 1]


# -- the hot path: direct calls while only the kernel's defaults answer ------------------------
HOT_HOOKS = ("sparrow_schedule", "sparrow_allocate_slots", "sparrow_execute_model")


class CountingHook:
    """Stands in for a hook caller and counts the dispatches that reach it."""

    def __init__(self, hook):
        self.hook = hook
        self.calls = 0

    def __call__(self, **kwargs):
        self.calls += 1
        return self.hook(**kwargs)

    def __getattr__(self, name):  # the plugin manager's own use: registration, get_hookimpls
        return getattr(self.hook, name)


@pytest.fixture
def counted_hooks(monkeypatch) -> dict[str, CountingHook]:
    pm = get_plugin_manager()
    counters = {name: CountingHook(getattr(pm.hook, name)) for name in HOT_HOOKS}
    for name, counter in counters.items():
        monkeypatch.setattr(pm.hook, name, counter)
    return counters


def tiny_engine_run(prompt_len: int = 6, max_tokens: int = 3) -> tuple[EngineCore, list[int]]:
    engine = engine_with(executor=None, device="tinydev")
    engine.add_request(make_request("a", prompt_len, max_tokens=max_tokens))
    return engine, run_to_completion(engine)["a"]


def test_with_only_builtins_the_hot_path_skips_the_hooks(counted_hooks):
    from sparrow.core import default_hooks

    with registered(TinyPlatformPlugin(), "tiny-platform"):
        engine, tokens = tiny_engine_run()
    assert len(tokens) == 3
    assert {name: c.calls for name, c in counted_hooks.items()} == dict.fromkeys(HOT_HOOKS, 0)
    # Resolved to the kernel's objects themselves.
    assert engine._schedule == engine.scheduler.schedule
    assert engine.scheduler._allocate is default_hooks.sparrow_allocate_slots
    assert engine.executor._execute == engine.executor.worker.execute_model


def test_a_wrapper_puts_its_hook_back_on_the_hot_path(counted_hooks):
    seen = {name: 0 for name in HOT_HOOKS}

    class Observer:
        @hookimpl(wrapper=True)
        def sparrow_schedule(self):
            seen["sparrow_schedule"] += 1
            return (yield)

        @hookimpl(wrapper=True)
        def sparrow_allocate_slots(self):
            seen["sparrow_allocate_slots"] += 1
            return (yield)

        @hookimpl(wrapper=True)
        def sparrow_execute_model(self):
            seen["sparrow_execute_model"] += 1
            return (yield)

    with registered(TinyPlatformPlugin(), "tiny-platform"), registered(Observer(), "observer"):
        _, tokens = tiny_engine_run()
    assert len(tokens) == 3
    # 3 steps (a prompt, two decodes), each with one allocation; every dispatch reached the wrapper.
    assert seen == dict.fromkeys(HOT_HOOKS, 3)
    assert {name: c.calls for name, c in counted_hooks.items()} == seen
    # Gone with the plugin: the next engine calls directly again.
    with registered(TinyPlatformPlugin(), "tiny-platform"):
        tiny_engine_run()
    assert {name: c.calls for name, c in counted_hooks.items()} == seen


def test_sparrow_attention_backend():
    cpu = resolve_platform("cpu")
    pm = get_plugin_manager()
    backend = pm.hook.sparrow_attention_backend(platform=cpu, requested="auto", model_config=None)
    assert backend.__name__ == "TorchPagedAttention"

    class Custom:
        @hookimpl(tryfirst=True)
        def sparrow_attention_backend(self, platform, requested):
            return "custom-backend" if requested == "mine" else None

    with registered(Custom(), "custom-attn"):
        assert pm.hook.sparrow_attention_backend(platform=cpu, requested="mine", model_config=None) == "custom-backend"
        assert pm.hook.sparrow_attention_backend(platform=cpu, requested="auto", model_config=None) is backend


def test_cuda_ranks_share_gpus_round_robin_when_there_are_fewer(monkeypatch):
    import torch

    from sparrow_cuda.platform import CudaPlatform

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    platform = CudaPlatform()
    assert [platform.device_for_rank(r) for r in range(4)] == [torch.device("cuda", i) for i in (0, 1, 0, 1)]


def test_sparrow_attention_backend_that_returns_no_class_names_the_plugin():
    # An instance (or a name, a function) fails where the hook answers, naming the plugin: in the
    # pre-flight when the backend is named, in the worker at start-up for "auto".
    from sparrow.engine.setup import finalize_config
    from sparrow.plugins import PluginError
    from sparrow_cpu.attention import TorchPagedAttention

    class Confused:
        @hookimpl(tryfirst=True)
        def sparrow_attention_backend(self, platform, requested, model_config):
            return "torch" if requested == "torch" else TorchPagedAttention.__new__(TorchPagedAttention)

    with registered(Confused(), "confused-attention"):
        with pytest.raises(PluginError, match=r"sparrow_attention_backend returned str 'torch', not a subclass of "
                                              r"sparrow.attention.AttentionBackend .*confused-attention"):
            finalize_config(EngineConfig.from_kwargs(device="cpu", attention_backend="torch"))
        with pytest.raises(PluginError, match=r"returned TorchPagedAttention .*the class, not an instance.*"
                                              r"confused-attention"):
            EngineCore(finalize_config(EngineConfig.from_kwargs(device="cpu", max_model_len=256,
                                                                kv_cache_memory_bytes=4 << 20)), executor=None)
