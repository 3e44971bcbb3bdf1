"""The plugin manager: entry points in the ``sparrow`` group, loaded once, lazily.

Built-in plugins (schedulers, cpu, cuda) are found exactly like a pip-installed one, through
``[project.entry-points.sparrow]``. ``SPARROW_PLUGINS=a,b`` loads only the named entry points.
Every entry point declares the hook-contract versions it supports (``SPARROW_CONTRACT``); one whose
range excludes ``sparrow.hookspecs.CONTRACT_VERSION`` is refused before it is registered.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from sparrow import hookspecs
from sparrow.hookspecs import CONTRACT_VERSION, PROJECT_NAME

logger = logging.getLogger(__name__)

# The kernel's own hook implementations (default allocation, built-in architectures, connectors).
KERNEL_PLUGINS = ("sparrow.core.default_hooks", "sparrow.models.registry", "sparrow.kv_transfer.shared_storage",
                  "sparrow.sample.logits_processor.registration", "sparrow.entrypoints.openai.parser_hooks",
                  "sparrow.kernel_components")
# The module whose hookimpls are the kernel's defaults of the core decision hooks (resolve_hook).
DEFAULT_HOOKS = "sparrow.core.default_hooks"
# The attribute (of a plugin's module or object) that declares the contract range it supports.
CONTRACT_ATTRIBUTE = "SPARROW_CONTRACT"


class PluginError(RuntimeError):
    """A plugin failed to load or implements a hook the contract does not have."""


def allowed_plugins() -> set[str] | None:
    """The ``SPARROW_PLUGINS`` allow-list, or None when every plugin may load."""
    value = os.environ.get("SPARROW_PLUGINS")
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    allowed = allowed_plugins()
    for ep in entry_points(group=PROJECT_NAME):
        if allowed is not None and ep.name not in allowed:
            logger.debug("plugin %s skipped by SPARROW_PLUGINS", ep.name)
            continue
        if pm.get_plugin(ep.name) is not None:
            continue  # the same distribution seen twice on sys.path
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - any failure is reported with the plugin's name
            raise PluginError(
                f"sparrow plugin {ep.name!r} ({ep.value}) failed to load: {exc!r}. "
                f"Exclude it with SPARROW_PLUGINS or uninstall it."
            ) from exc
        check_contract(plugin, ep.name)
        register_plugin(pm, plugin, ep.name)


def suggested_contract_range() -> str:
    """The range a plugin written against this Sparrow declares: this minor version and later,
    up to the next major one (which may remove or change hooks)."""
    version = Version(CONTRACT_VERSION)
    return f">={version.major}.{version.minor},<{version.major + 1}"


def declared_contract(plugin: Any) -> Any:
    """The plugin's ``SPARROW_CONTRACT``: on the plugin itself, or else on the module that defines
    it (an entry point may name an object in a module, as the step tracer's does)."""
    declared = getattr(plugin, CONTRACT_ATTRIBUTE, None)
    if declared is None and not inspect.ismodule(plugin):
        owner = plugin if inspect.isclass(plugin) or inspect.isfunction(plugin) else type(plugin)
        declared = getattr(inspect.getmodule(owner), CONTRACT_ATTRIBUTE, None)
    return declared


def check_contract(plugin: Any, name: str) -> None:
    """Refuse ``plugin`` when the contract range it declares excludes this Sparrow's
    (PluginError naming the plugin, its range and the installed version); warn once, when it
    loads, if it declares none."""
    declared = declared_contract(plugin)
    suggested = suggested_contract_range()
    if declared is None:
        logger.warning("sparrow plugin %r does not declare the hook contract versions it supports; add "
                       "%s = %r to its module so that a Sparrow it does not support refuses it at load "
                       "(this Sparrow's contract is %s)", name, CONTRACT_ATTRIBUTE, suggested, CONTRACT_VERSION)
        return
    try:
        if not isinstance(declared, str):
            raise InvalidSpecifier(f"{declared!r} is not a string")
        supported = SpecifierSet(declared)
    except InvalidSpecifier as exc:
        raise PluginError(f"sparrow plugin {name!r} declares {CONTRACT_ATTRIBUTE} = {declared!r}, which is not "
                          f"a PEP 440 version range such as {suggested!r}: {exc}") from exc
    if not supported.contains(CONTRACT_VERSION, prereleases=True):
        raise PluginError(
            f"sparrow plugin {name!r} supports hook contract {declared!r}, but the installed Sparrow's contract is "
            f"{CONTRACT_VERSION}: install a version of the plugin made for contract {CONTRACT_VERSION}, or exclude "
            f"it with SPARROW_PLUGINS."
        )


def register_plugin(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """Register ``plugin`` and check its hook names, with errors that name the plugin."""
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        pm.unregister(name=name)
        raise PluginError(f"sparrow plugin {name!r} is invalid: {exc}") from exc


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager, with the kernel hooks and every allowed entry point."""
    import importlib

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for module_name in KERNEL_PLUGINS:
        register_plugin(pm, importlib.import_module(module_name), module_name)
    _load_entry_points(pm)
    return pm


def kernel_default_only(pm: pluggy.PluginManager, hook_name: str) -> bool:
    """Whether the kernel's default (``sparrow.core.default_hooks``) is the only implementation of
    ``hook_name``: no plugin replaces it and none wraps it, so the caller may skip the dispatch
    and call the kernel's object itself. Asked once, at start-up, by the hook's caller."""
    impls = getattr(pm.hook, hook_name).get_hookimpls()
    return len(impls) == 1 and impls[0].plugin_name == DEFAULT_HOOKS


def resolve_hook(pm: pluggy.PluginManager, hook_name: str, returns: type | tuple[type, ...] | None = None
                 ) -> Callable[..., Any]:
    """What to call for ``hook_name`` (with the hookspec's keywords): the kernel default's function
    when it is the only implementation (a direct call), else the hook with its plugins, whose
    result must then be a ``returns`` (see :func:`check_hook_result`)."""
    hook = getattr(pm.hook, hook_name)
    if kernel_default_only(pm, hook_name):
        return hook.get_hookimpls()[0].function
    if returns is None:
        return hook

    def call(**kwargs: Any) -> Any:
        return check_hook_result(pm, hook_name, hook(**kwargs), returns)
    return call


def check_hook_result(pm: pluggy.PluginManager, hook_name: str, result: Any,
                      expected: type | tuple[type, ...]) -> Any:
    """``result`` when it is an ``expected``; else a PluginError naming the hook's implementations
    (a plugin returned the wrong thing: better here than an AttributeError deep in the kernel)."""
    if isinstance(result, expected):
        return result
    names = " or ".join("None" if kind is type(None) else kind.__name__
                        for kind in (expected if isinstance(expected, tuple) else (expected,)))
    raise _wrong_result(pm, hook_name, result, names)


def check_attention_backend(pm: pluggy.PluginManager, backend: Any) -> type | None:
    """What ``sparrow_attention_backend`` answered: None, or a subclass of
    :class:`sparrow.attention.AttentionBackend`; anything else is a PluginError naming the hook's
    implementations (an instance, a function or a name would fail later, inside a worker)."""
    if backend is None:
        return None
    from sparrow.attention import AttentionBackend

    if isinstance(backend, type) and issubclass(backend, AttentionBackend):
        return backend
    raise _wrong_result(pm, "sparrow_attention_backend", backend,
                        "a subclass of sparrow.attention.AttentionBackend (the class, not an instance)")


def _wrong_result(pm: pluggy.PluginManager, hook_name: str, result: Any, expected: str) -> PluginError:
    plugins = ", ".join(impl.plugin_name for impl in getattr(pm.hook, hook_name).get_hookimpls())
    return PluginError(f"{hook_name} returned {type(result).__name__} {result!r:.80}, not {expected}; "
                       f"its implementations: {plugins}")


@dataclass(slots=True)
class PlatformEntry:
    name: str
    detect: Callable[[], str | None]
    priority: int
    plugin: str


@dataclass(slots=True)
class Registry:
    """Everything the registration hooks registered, by name."""

    platforms: dict[str, PlatformEntry] = field(default_factory=dict)
    schedulers: dict[str, type] = field(default_factory=dict)
    kv_connectors: dict[str, type] = field(default_factory=dict)
    architectures: dict[str, str] = field(default_factory=dict)
    logits_processors: dict[str, Any] = field(default_factory=dict)  # name -> class or "module:Class"
    tool_parsers: dict[str, Any] = field(default_factory=dict)  # name -> class or "module:Class"
    reasoning_parsers: dict[str, Any] = field(default_factory=dict)  # name -> class or "module:Class"
    ops: dict[str, dict[str, Any]] = field(default_factory=dict)  # op -> {platform: impl or "module:Name"}
    device_communicators: dict[str, Any] = field(default_factory=dict)  # name -> class or "module:Class"
    quantization_methods: dict[str, Any] = field(default_factory=dict)  # name -> class or "module:Class"
    model_loaders: dict[str, Any] = field(default_factory=dict)  # name -> class or "module:Class"
    kv_eviction_policies: dict[str, Any] = field(default_factory=dict)  # name -> class or "module:Class"
    spec_proposers: dict[str, Any] = field(default_factory=dict)  # method -> class or "module:Class"
    stat_loggers: dict[str, Any] = field(default_factory=dict)  # name -> class or "module:Class"


def _collect(pm: pluggy.PluginManager, hook_name: str, make_register: Callable) -> None:
    hook = getattr(pm.hook, hook_name)
    for impl in hook.get_hookimpls():
        try:
            impl.function(**{k: make_register(impl.plugin_name) for k in impl.argnames if k == "register"})
        except PluginError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is reported with the plugin's name
            raise PluginError(f"sparrow plugin {impl.plugin_name!r} failed in {hook_name}: {exc!r}. "
                              f"Exclude it with SPARROW_PLUGINS or uninstall it.") from exc


def check_registered_object(kind: str, name: str, plugin: str, obj: Any, *, classes_only: bool = False) -> None:
    """Refuse, when it is registered, what could never be resolved later: a ``kind`` entry must be
    a class (or, unless ``classes_only``, any callable) or an import path ``"package.module:Name"``."""
    if isinstance(obj, str):
        module_name, _, attr = obj.partition(":")
        if module_name and attr:
            return
        problem = f"the import path {obj!r} is not of the form 'package.module:Name'"
    elif inspect.isclass(obj) or (callable(obj) and not classes_only):
        return
    else:
        problem = f"{obj!r} is not a class or an import path 'package.module:Class'"
    raise PluginError(f"sparrow plugin {plugin!r} registered {kind} {name!r} wrongly: {problem}")


def build_registry(pm: pluggy.PluginManager) -> Registry:
    reg = Registry()
    owners: dict[tuple[str, str], tuple[str, bool]] = {}

    def claim(kind: str, name: str, plugin: str, override: bool = False) -> bool:
        """Whether ``plugin``'s registration of ``name`` is kept: an override wins over a plain
        registration whichever comes first (entry points load in sys.path order)."""
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {kind} with an invalid name {name!r}")
        previous = owners.get((kind, name))
        if previous is not None and previous[1] == override:
            hint = "" if override else "; the one that replaces the other passes override=True"
            raise PluginError(f"{kind} {name!r} is registered by both {previous[0]!r} and {plugin!r}{hint}")
        if previous is not None and previous[1]:
            return False  # an earlier plugin already replaced this one's registration
        owners[(kind, name)] = (plugin, override)
        return True

    def platforms(plugin: str):
        def register(name: str, detect: Callable[[], str | None], priority: int = 0) -> None:
            if not callable(detect):
                raise PluginError(f"sparrow plugin {plugin!r} registered platform {name!r} with detect={detect!r}, "
                                  f"which is not callable: pass a function returning 'package.module:Class' or None")
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise PluginError(f"sparrow plugin {plugin!r} registered platform {name!r} with priority "
                                  f"{priority!r}, which is not an int")
            claim("platform", name, plugin)
            reg.platforms[name] = PlatformEntry(name, detect, priority, plugin)
        return register

    def schedulers(plugin: str):
        def register(name: str, scheduler_cls: type, override: bool = False) -> None:
            check_registered_object("scheduler", name, plugin, scheduler_cls, classes_only=True)
            if claim("scheduler", name, plugin, override):
                reg.schedulers[name] = scheduler_cls
        return register

    def connectors(plugin: str):
        def register(name: str, connector_cls: type, override: bool = False) -> None:
            check_registered_object("kv connector", name, plugin, connector_cls, classes_only=True)
            if claim("kv connector", name, plugin, override):
                reg.kv_connectors[name] = connector_cls
        return register

    def architectures(plugin: str):
        def register(architecture: str, import_path: str, override: bool = False) -> None:
            if not isinstance(import_path, str):
                raise PluginError(f"sparrow plugin {plugin!r} registered architecture {architecture!r} as "
                                  f"{import_path!r}: pass the import path 'package.module:ModelClass'")
            check_registered_object("architecture", architecture, plugin, import_path)
            if claim("architecture", architecture, plugin, override):
                reg.architectures[architecture] = import_path
        return register

    def logits_processors(plugin: str):
        def register(name: str, processor: Any, override: bool = False) -> None:
            check_registered_object("logits processor", name, plugin, processor, classes_only=True)
            if claim("logits processor", name, plugin, override):
                reg.logits_processors[name] = processor
        return register

    def parsers(kind: str, table: dict[str, Any], plugin: str):
        def register(name: str, parser_cls: Any, override: bool = False) -> None:
            check_registered_object(kind, name, plugin, parser_cls, classes_only=True)
            if claim(kind, name, plugin, override):
                table[name] = parser_cls
        return register

    def ops(plugin: str):
        def register(op: str, platform: str, impl: Any, override: bool = False) -> None:
            from sparrow.ops import KERNEL_OPS

            if op not in KERNEL_OPS:
                raise PluginError(f"plugin {plugin!r} registered an implementation of unknown op {op!r}; "
                                  f"ops: {', '.join(KERNEL_OPS)}")
            if not isinstance(platform, str) or not platform:
                raise PluginError(f"plugin {plugin!r} registered op {op!r} for an invalid platform {platform!r}")
            check_registered_object("op", f"{op} on {platform}", plugin, impl)
            if claim("op", f"{op} on {platform}", plugin, override):
                reg.ops.setdefault(op, {})[platform] = impl
        return register

    _collect(pm, "sparrow_register_platforms", platforms)
    _collect(pm, "sparrow_register_schedulers", schedulers)
    _collect(pm, "sparrow_register_kv_connectors", connectors)
    _collect(pm, "sparrow_register_model_architectures", architectures)
    _collect(pm, "sparrow_register_logits_processors", logits_processors)
    _collect(pm, "sparrow_register_tool_parsers", lambda plugin: parsers("tool parser", reg.tool_parsers, plugin))
    _collect(pm, "sparrow_register_reasoning_parsers",
             lambda plugin: parsers("reasoning parser", reg.reasoning_parsers, plugin))
    _collect(pm, "sparrow_register_ops", ops)
    _collect(pm, "sparrow_register_device_communicators",
             lambda plugin: parsers("device communicator", reg.device_communicators, plugin))
    _collect(pm, "sparrow_register_quantization_methods",
             lambda plugin: parsers("quantization method", reg.quantization_methods, plugin))
    _collect(pm, "sparrow_register_model_loaders", lambda plugin: parsers("model loader", reg.model_loaders, plugin))
    _collect(pm, "sparrow_register_kv_eviction_policies",
             lambda plugin: parsers("kv eviction policy", reg.kv_eviction_policies, plugin))
    _collect(pm, "sparrow_register_spec_proposers",
             lambda plugin: parsers("speculative proposer", reg.spec_proposers, plugin))
    _collect(pm, "sparrow_register_stat_loggers", lambda plugin: parsers("stat logger", reg.stat_loggers, plugin))
    return reg


# pm -> (the plugins it held, their registry): the registration hooks run once per set of plugins.
_REGISTRIES: weakref.WeakKeyDictionary[pluggy.PluginManager, tuple[list[Any], Registry]] = weakref.WeakKeyDictionary()


def get_registry(pm: pluggy.PluginManager | None = None) -> Registry:
    """Registrations of ``pm`` (default: the process's plugin manager). Cheap to call again: the
    registration hooks run again only after a plugin was registered or unregistered. Read it, never
    change it (every caller shares it)."""
    pm = pm or get_plugin_manager()
    plugins = [plugin for _, plugin in pm.list_name_plugin()]
    cached = _REGISTRIES.get(pm)
    if cached is not None and len(cached[0]) == len(plugins) and all(a is b for a, b in zip(cached[0], plugins)):
        return cached[1]
    registry = build_registry(pm)
    _REGISTRIES[pm] = (plugins, registry)
    return registry


def import_object(import_path: str) -> Any:
    """Import ``"package.module:attr"``; an ImportError naming ``import_path`` when that fails."""
    import importlib

    module_name, _, attr = import_path.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr) if attr else module
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"cannot import {import_path!r}: {exc}") from exc


def resolve_parser(kind: str, name: str, table: dict[str, Any]) -> type:
    """The class registered as ``name`` in ``table`` (importing an ``"module:Class"`` entry);
    ValueError naming ``kind`` and the registered names when there is none."""
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(table)) or 'none'}")
    entry = table[name]
    if not isinstance(entry, str):
        return entry
    try:
        return import_object(entry)
    except ImportError as exc:
        raise PluginError(f"{kind} {name!r} is registered as {entry!r}, which does not import: {exc.__cause__!r}. "
                          f"`sparrow plugins` lists which plugin registers it.") from exc
