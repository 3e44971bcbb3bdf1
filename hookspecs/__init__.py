"""The hook contract between Sparrow's kernel and its plugins.

Every hook is called with keyword arguments, so an implementation may accept fewer arguments than
the spec lists (pluggy passes only the ones it names) and specs can grow without breaking plugins.

Docstring template, the same for every hook:

    Summary line.

    When: the moment and the process in which the kernel calls it.
    Args: each argument.
    Returns: the result and its meaning.
    Semantics: firstresult ("stops at the first non-None result") or collecting, and how a
        plugin overrides (``tryfirst=True``) or observes (``wrapper=True``) it.

Plugins implement hooks with :data:`hookimpl`; the kernel alone creates the plugin manager
(``sparrow.plugins``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:  # annotations only: importing this module must stay cheap
    from sparrow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from sparrow.core.request import Request
    from sparrow.core.sched.interface import SchedulerInterface
    from sparrow.core.sched.output import SchedulerOutput
    from sparrow.worker.outputs import ModelRunnerOutput

PROJECT_NAME = "sparrow"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]


# --------------------------------------------------------------------------------------------
# Registration hooks: called once when the plugin manager is first used.
# --------------------------------------------------------------------------------------------


@hookspec
def sparrow_register_platforms(register: Callable[..., None]) -> None:
    """Register hardware platforms.

    When: once per process, the first time a platform is resolved (engine start-up, or
        ``sparrow plugins``), in every process that resolves one.
    Args:
        register: ``register(name, detect, priority=0)``. ``name`` is what users pass as
            ``device=``; ``detect()`` is a cheap check that must not import heavy code (no torch
            import at module level, no device initialisation beyond a query) and returns the import
            path ``"package.module:PlatformClass"`` when the device is present, else None.
            ``priority`` orders the present platforms for ``device="auto"`` (highest wins).
    Returns: nothing; registration goes through the callback, which rejects duplicate names.
    Semantics: collecting; every implementation is called.
    """


@hookspec
def sparrow_register_schedulers(register: Callable[..., None]) -> None:
    """Register scheduler policies by name.

    When: once per engine-core process, when the engine core builds its scheduler.
    Args:
        register: ``register(name, scheduler_cls)`` where ``scheduler_cls`` subclasses
            :class:`sparrow.core.sched.scheduler.Scheduler` (reusing its budgeting, preemption and
            allocation) or implements :class:`sparrow.core.sched.interface.SchedulerInterface`.
    Returns: nothing.
    Semantics: collecting; duplicate names are an error naming both plugins.
    """


@hookspec
def sparrow_register_kv_connectors(register: Callable[..., None]) -> None:
    """Register KV connectors by name.

    When: once per process that builds a connector (engine core: scheduler side; worker: worker
        side), when ``kv_connector`` is set in the configuration.
    Args:
        register: ``register(name, connector_cls)``; the class implements
            :class:`sparrow.kv_transfer.KVConnectorBase`.
    Returns: nothing.
    Semantics: collecting.
    """


@hookspec
def sparrow_register_model_architectures(register: Callable[..., None]) -> None:
    """Register model architectures by the name in ``config.json``'s ``architectures`` list.

    When: once per process that loads a model (the worker), before the model is built.
    Args:
        register: ``register(architecture, import_path)`` with ``import_path`` of the form
            ``"package.module:ModelClass"``; the class is imported only if it is used.
    Returns: nothing.
    Semantics: collecting; a later registration of the same name is an error unless the plugin
        passes ``override=True``.
    """


@hookspec
def sparrow_register_logits_processors(register: Callable[..., None]) -> None:
    """Register logits processors by name.

    When: once per process that resolves logits processors: the frontend, before any engine
        process starts (``logits_processors`` names are checked, and enabled processors'
        ``validate_params`` run there for each request), and every worker at start-up, where
        each enabled processor is built once.
    Args:
        register: ``register(name, processor, override=False)``; ``processor`` is a class
            implementing :class:`sparrow.sample.logits_processor.LogitsProcessor`, or its import
            path ``"package.module:Class"`` (imported only when enabled). The built-ins
            (allowed_token_ids, bad_words, min_tokens, logit_bias) register through this hook
            and are always enabled; any other runs only in engines that list its name in the
            ``logits_processors`` engine argument.
    Returns: nothing.
    Semantics: collecting; a name registered twice is an error naming both plugins, unless the
        later registration passes ``override=True`` (how a plugin replaces a built-in).
    """


@hookspec
def sparrow_register_tool_parsers(register: Callable[..., None]) -> None:
    """Register tool-call parsers by name (the names ``--tool-call-parser`` accepts).

    When: once per server process, when ``sparrow serve`` starts (the name is checked before the
        model loads) and when its app is built; the chosen parser then runs in the server process
        for every ``tool_choice: "auto"`` request.
    Args:
        register: ``register(name, parser_cls, override=False)``; ``parser_cls`` subclasses
            :class:`sparrow.entrypoints.openai.tool_parsers.ToolParser` (or its import path
            ``"package.module:Class"``). The server builds one per choice of a request,
            ``parser_cls(tokenizer, request)``. The built-ins (hermes, llama3_json) register
            through this hook.
    Returns: nothing.
    Semantics: collecting; a name registered twice is an error naming both plugins, unless the
        later registration passes ``override=True`` (how a plugin replaces a built-in).
    """


@hookspec
def sparrow_register_reasoning_parsers(register: Callable[..., None]) -> None:
    """Register reasoning parsers by name (the names the ``reasoning_parser`` engine argument accepts).

    When: once per process that resolves one: the frontend (``reasoning_parser`` is checked before
        any engine process starts; the server builds the parser to split ``reasoning_content``)
        and the engine core, on its first structured-output request (the parser says where the
        reasoning ends, so the grammar applies only after it).
    Args:
        register: ``register(name, parser_cls, override=False)``; ``parser_cls`` subclasses
            :class:`sparrow.reasoning.ReasoningParser` (or its import path
            ``"package.module:Class"``) and is built once per process as ``parser_cls(tokenizer)``.
            The built-ins (qwen3, deepseek_r1) register through this hook.
    Returns: nothing.
    Semantics: collecting; a name registered twice is an error naming both plugins, unless the
        later registration passes ``override=True``.
    """


@hookspec
def sparrow_register_ops(register: Callable[..., None]) -> None:
    """Register a platform's implementations of the kernel's ops (``sparrow.ops.KERNEL_OPS``).

    When: once per process that builds a model or a sampler (every worker, at start-up, before the
        model is built), and in ``sparrow plugins`` (which lists them, importing nothing).
    Args:
        register: ``register(op, platform, impl, override=False)``. ``op`` is a kernel op name
            (``linear``, ``rms_norm``, ``top_k_top_p``...); ``platform`` the platform name the
            implementation serves; ``impl`` is, for a layer op, a subclass of
            :class:`sparrow.ops.OpImpl` built once per layer after the weights load (where it may
            repack them), and for a function op a function with the reference's signature; either
            may be given as its import path ``"package.module:Name"``, imported only when used.
    Returns: nothing.
    Semantics: collecting; one implementation per (op, platform): a second is an error naming both
        plugins, unless it passes ``override=True`` (how a plugin replaces a built-in kernel).
    """


@hookspec
def sparrow_register_device_communicators(register: Callable[..., None]) -> None:
    """Register device communicators: the collective backends tensor parallelism uses.

    When: once per worker process of an engine with ``tensor_parallel_size > 1``, when the
        worker joins its group; the communicator is chosen by the platform's ``communicator``
        attribute (default ``"torch_distributed"``, built in).
    Args:
        register: ``register(name, communicator_cls, override=False)``; the class implements
            :class:`sparrow.distributed.DeviceCommunicator` (or is its import path).
    Returns: nothing.
    Semantics: collecting; duplicate names are an error unless ``override=True``.
    """


@hookspec
def sparrow_register_quantization_methods(register: Callable[..., None]) -> None:
    """Register quantization methods by the name the ``quantization`` engine argument takes.

    When: once per process that resolves one: the frontend (the name is checked before any engine
        process starts) and each worker, before the model is built.
    Args:
        register: ``register(name, method_cls, override=False)``; the class implements
            :class:`sparrow.quantization.QuantizationMethod` (or is its import path).
    Returns: nothing.
    Semantics: collecting; duplicate names are an error unless ``override=True``.
    """


@hookspec
def sparrow_register_model_loaders(register: Callable[..., None]) -> None:
    """Register model loaders by the name the ``load_format`` engine argument takes.

    When: once per process that resolves one: the frontend (the name is checked before any engine
        process starts) and each worker, when it loads the model.
    Args:
        register: ``register(name, loader_cls, override=False)``; the class implements
            :class:`sparrow.model_loader.ModelLoader` (or is its import path). The built-ins are
            ``safetensors`` (``auto``) and ``dummy`` (random weights).
    Returns: nothing.
    Semantics: collecting; duplicate names are an error unless ``override=True``.
    """


# --------------------------------------------------------------------------------------------
# Core decision hooks: called on the hot path.
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def sparrow_schedule(scheduler: SchedulerInterface) -> SchedulerOutput | None:
    """Decide what runs in the next engine step.

    When: once per engine step, in the engine-core process, before the model executes.
    Args:
        scheduler: the engine's scheduler, built from the ``scheduler=`` configuration.
    Returns: the step's :class:`SchedulerOutput` (``{request_id: num_new_tokens}`` plus new and
        cached request data).
    Semantics: firstresult, stops at the first non-None result. The built-in scheduler plugin
        returns ``scheduler.schedule()``; a plugin replaces the decision with ``tryfirst=True`` or
        observes it with ``wrapper=True``.
    """


@hookspec(firstresult=True)
def sparrow_allocate_slots(
    kv_cache_manager: KVCacheManager,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: KVCacheBlocks | None,
) -> KVCacheBlocks | None:
    """Allocate KV-cache slots for ``num_new_tokens`` more tokens of ``request``.

    When: in the engine-core process, each time the scheduler needs slots for a request (every
        scheduled request, every step).
    Args:
        kv_cache_manager: the kernel's KV-cache manager.
        request: the request being scheduled.
        num_new_tokens: tokens to compute this step.
        num_new_computed_tokens: tokens newly found in the prefix cache (waiting requests only).
        new_computed_blocks: the cached blocks that hold them, or None.
    Returns: the newly allocated blocks, or None when they cannot fit (the scheduler then
        preempts, or leaves the waiting request waiting).
    Semantics: firstresult; the kernel's default (``KVCacheManager.allocate_slots``) runs last and
        its None means "cannot fit". A plugin that wants the default decision returns None.
    """


@hookspec(firstresult=True)
def sparrow_execute_model(worker: Any, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
    """Run the model for one scheduled step and sample.

    When: once per engine step, in every worker process (rank 0 returns what the engine uses).
    Args:
        worker: the platform's worker, which owns the model runner and the KV cache.
        scheduler_output: what the scheduler decided for this step.
    Returns: a :class:`ModelRunnerOutput` with the sampled token ids per request.
    Semantics: firstresult. Each platform plugin answers for its own workers (and returns None
        for others); observe with ``wrapper=True`` (for example to time steps).
    """


@hookspec(firstresult=True)
def sparrow_attention_backend(platform: Any, requested: str, model_config: Any) -> type | None:
    """Choose the attention backend class for a worker.

    When: once per worker, at start-up, before the model is built; and once in the frontend
        process before any engine process starts, when ``attention_backend`` names a backend
        (not ``"auto"``), so that an unknown name is a ``ConfigError`` before the model loads.
        Implementations must therefore be cheap to call and import heavy code only when chosen.
    Args:
        platform: the worker's platform object (``platform.name`` says which).
        requested: the ``attention_backend`` configuration value (``"auto"`` or a name).
        model_config: the model configuration (head size, dtype...).
    Returns: a class implementing :class:`sparrow.attention.AttentionBackend`, or None when this
        plugin does not serve that platform or name.
    Semantics: firstresult; platform plugins answer for their own platform.
    """
