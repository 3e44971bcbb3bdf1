"""EngineCore: one step is schedule -> execute_model -> update_from_output."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from sparrow.config import EngineConfig
from sparrow.core.kv_cache_manager import KVCacheManager
from sparrow.core.request import FinishReason, Request, RequestStatus
from sparrow.core.sched.output import SchedulerOutput
from sparrow.engine.core_parts import (  # noqa: F401 - eviction_policy_class is imported from here too
    build_scheduler,
    check_connector_supports,
    eviction_policy_class,
    schedule_step,
    worker_kv_cache_groups,
)
from sparrow.engine.core_pause import PauseState, pause, resume
from sparrow.engine.kv_events import start_kv_events
from sparrow.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from sparrow.engine.request_guard import check_request, model_hidden_size, model_vocab_size
from sparrow.engine.sleep_args import SLEEP_TAGS, check_sleep, check_wake_up_tags
from sparrow.executor import Executor, make_executor
from sparrow.executor.abstract import StepHandle
from sparrow.plugins import (
    get_plugin_manager,
)

logger = logging.getLogger(__name__)


class EngineCore:
    """The engine's inner loop. Runs in-process (``InprocClient``) or in its own process."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        if config.model.max_model_len is None:
            raise ValueError("EngineCore needs a resolved max_model_len (see sparrow.engine.setup)")
        self.config = config
        self.pm = get_plugin_manager()
        # Resolved before any worker starts: an unknown name must not leave workers behind.
        eviction_policy = eviction_policy_class(config.cache.kv_eviction_policy, self.pm)
        self.executor = executor if executor is not None else make_executor(config)
        started = time.perf_counter()
        kv_info = self.executor.initialize()
        logger.info("engine core ready in %.2fs: %d KV blocks of %d tokens",
                    time.perf_counter() - started, kv_info.num_blocks, kv_info.block_size)
        self.num_kv_blocks = kv_info.num_blocks
        self.block_size = kv_info.block_size
        kv_cache_groups = worker_kv_cache_groups(self.executor)
        try:
            check_connector_supports(config, kv_cache_groups)
        except ValueError:
            self.executor.shutdown()  # the workers are up: do not leave them behind
            raise
        self.kv_cache_manager = KVCacheManager(
            num_blocks=kv_info.num_blocks, block_size=kv_info.block_size,
            enable_caching=config.cache.enable_prefix_caching, kv_cache_groups=kv_cache_groups,
            max_num_batched_tokens=config.max_num_batched_tokens,
            eviction_policy=eviction_policy,
        )
        self.kv_events = start_kv_events(config, self.kv_cache_manager.block_pool)
        self.scheduler = build_scheduler(config, self.kv_cache_manager, self.pm)
        self._schedule = schedule_step(self.pm, self.scheduler)
        # None when the model directory cannot tell (fake executors in tests): token ids are then
        # checked for sign only.
        self.vocab_size = model_vocab_size(config.model)
        # What prompt embeddings must match (enable_prompt_embeds); None: they are refused.
        self.prompt_embeds_hidden_size = model_hidden_size(config.model) if config.model.enable_prompt_embeds else None
        # Structured outputs: built on the first constrained request (it loads the tokenizer).
        self._structured_output: Any = None
        self._grammar_pending: dict[str, Request] = {}  # req_id -> request whose grammar compiles
        self._sleeping_tags: set[str] = set()  # sleep mode: the tags sleep() released and not woken
        # vLLM's pause_generation (sparrow.engine.core_pause), and outputs made between steps (a
        # pause's aborts, steps collected early) that go out with the next step's.
        self.pause_state = PauseState()
        self._deferred: list[EngineCoreOutput] = []
        # Overlapped scheduling: the steps started and not yet collected, oldest first (None: off).
        self._in_flight: deque[tuple[SchedulerOutput, StepHandle]] | None = None
        if config.scheduler.async_scheduling:
            self._in_flight = deque()
            self.scheduler.async_scheduling = True

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises ValueError when the request can never run; any other exception means adding it
        failed, and the scheduler keeps nothing of it. Either way the caller fails that request
        alone (``EngineCoreProc`` answers it with an error output)."""
        if self._sleeping_tags:
            raise ValueError(f"the engine is asleep ({', '.join(sorted(self._sleeping_tags))} released by sleep()); "
                             "call wake_up() before adding requests")
        check_request(request, vocab_size=self.vocab_size, max_model_len=self.config.model.max_model_len or 0,
                      pooling=self.config.model.runner == "pooling",
                      prompt_embeds_hidden_size=self.prompt_embeds_hidden_size)
        core_request = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time or None,
            priority=request.priority,
            max_tokens=request.max_tokens,
            lora_request=request.lora_request,
            cache_salt=request.cache_salt,
            pooling_task=request.pooling_params.task if request.pooling_params is not None else None,
            prompt_embeds=request.prompt_embeds,
        )
        if request.lora_request is not None:
            from sparrow.lora.engine import check_lora_request

            check_lora_request(request.lora_request, self.config, self.lora_hf_config())
        if request.sampling_params.structured_outputs is not None:
            core_request.structured_output = self.structured_output_manager().new_request(
                request.sampling_params.structured_outputs,
                request.prompt_token_ids if request.prompt_embeds is None else None)  # placeholders say nothing
            core_request.status = RequestStatus.WAITING_FOR_GRAMMAR
        if self.pause_state.paused:
            self.pause_state.held.append(core_request)  # scheduled on resume (core_pause)
            return
        self._schedule_request(core_request)

    def _schedule_request(self, core_request: Request) -> None:
        """Hand a checked request to the scheduler (ValueError: it can never run)."""
        try:
            self.scheduler.add_request(core_request)
            if core_request.structured_output is not None:
                self._grammar_pending[core_request.request_id] = core_request
        except ValueError:
            raise  # the interface's rejection: raised before the scheduler kept anything
        except Exception:
            # A scheduler (a plugin's, say) failed half-way: it must not keep a request nobody
            # will hear of again, or schedule it with half its state.
            try:
                self.scheduler.finish_requests([core_request.request_id], RequestStatus.FINISHED_ABORTED)
            except Exception:  # noqa: BLE001 - best effort; the original error is what matters
                logger.exception("could not remove request %s after its add failed", core_request.request_id)
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.pause_state.drop(set(request_ids))
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Whether step() has work: running or waiting requests (not while frozen by a pause),
        steps in flight, or outputs to send."""
        return ((self.scheduler.has_unfinished_requests() and not self.pause_state.frozen)
                or bool(self._in_flight) or bool(self._deferred))

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        failed = self._fail_uncompiled_grammars() if self._grammar_pending else []
        if self._deferred:
            failed, self._deferred = self._deferred + failed, []
        if self.pause_state.frozen:
            return self._outputs(failed)
        if self._in_flight is not None:
            return self._step_overlapped(failed)
        if not self.scheduler.has_unfinished_requests():
            return self._outputs(failed)
        scheduler_output = self._schedule_step()
        if scheduler_output is None:
            # Nothing fits this step (e.g. waiting on remote KV or on a grammar's compile, or a
            # plugin vetoed every allocation): yield the CPU briefly instead of spinning.
            time.sleep(0.001)
            return self._outputs(failed)
        model_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        return self._outputs(failed + outputs)

    def _step_overlapped(self, failed: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """Overlapped scheduling: start steps until two are in flight (the second is scheduled
        while the first runs, its sampled tokens counted as placeholders), then collect the
        oldest. Greedy and seeded tokens are those of ``step``: the worker feeds each step's
        sampled tokens to the next itself, in order."""
        in_flight = self._in_flight
        while len(in_flight) < 2 and self.scheduler.has_unfinished_requests() and \
                (not in_flight or self._may_schedule_ahead()):
            scheduler_output = self._schedule_step()
            if scheduler_output is None:
                break
            in_flight.append((scheduler_output, self.executor.execute_model_async(scheduler_output)))
        if not in_flight:
            time.sleep(0.001)  # nothing fits this step (see step)
            return self._outputs(failed)
        scheduler_output, future = in_flight.popleft()
        outputs = self.scheduler.update_from_output(scheduler_output, future.result())
        return self._outputs(failed + outputs)

    def _may_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the running one's tokens are back: not
        while a request with a grammar is unfinished, whose mask for the next token depends on
        the token in flight."""
        if self._structured_output is None:
            return True
        count = getattr(self.scheduler, "num_structured_requests", None)
        if count is not None:
            return count == 0
        return not any(r.structured_output is not None for r in getattr(self.scheduler, "requests", {}).values())

    def _schedule_step(self) -> SchedulerOutput | None:
        """The next step's scheduler output with its grammar masks; None when it has no tokens."""
        scheduler_output = self._schedule()
        if scheduler_output is None:
            raise RuntimeError("no plugin answered sparrow_schedule")
        if scheduler_output.total_num_scheduled_tokens == 0:
            return None
        if self._structured_output is not None:
            self._attach_grammar_bitmask(scheduler_output)
        return scheduler_output

    def _outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        self._publish_kv_events()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.monotonic())

    # -- structured outputs -----------------------------------------------------------------
    def structured_output_manager(self) -> Any:
        if self._structured_output is None:
            from sparrow.engine.setup import model_eos_token_ids
            from sparrow.plugin_files import load_reasoning_parser_plugin
            from sparrow.structured_output.manager import StructuredOutputManager

            model = self.config.model
            load_reasoning_parser_plugin(model.reasoning_parser_plugin)  # this process has not loaded it
            if self.vocab_size is None or not model.tokenizer:
                raise ValueError("structured outputs need the model's vocabulary size and tokenizer, "
                                 "which this engine core could not read")
            self._structured_output = StructuredOutputManager(
                model.tokenizer, vocab_size=self.vocab_size,
                stop_token_ids=model_eos_token_ids(model.model) if model.model else [],
                any_whitespace=model.structured_outputs_any_whitespace,
                max_num_reqs=self.config.scheduler.max_num_seqs, reasoning_parser=model.reasoning_parser,
                compile_timeout=model.structured_outputs_compile_timeout,
                mask_budget_ms=model.structured_outputs_mask_budget_ms,
                trust_remote_code=model.trust_remote_code, tokenizer_mode=model.tokenizer_mode)
        return self._structured_output

    def _fail_uncompiled_grammars(self) -> list[EngineCoreOutput]:
        """Finish, with an error output each, the requests whose grammar failed: to compile (the
        frontend parses every grammar first, so this is rare: a compile-only failure, a compile
        past the timeout, or a client that skipped the frontend), or later, when its token masks
        cost too much (``_attach_grammar_bitmask`` puts those back in ``_grammar_pending``)."""
        failed: list[EngineCoreOutput] = []
        for req_id, request in list(self._grammar_pending.items()):
            if not request.structured_output.done():
                continue
            del self._grammar_pending[req_id]
            message = request.structured_output.error()
            if message is None or request.is_finished():
                continue
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            failed.append(EngineCoreOutput(request_id=req_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                                           error_message=message,
                                           error_field=request.structured_output.error_field()))
        return failed

    def _attach_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Fill the bitmask of every constrained request that samples a token this step (a
        prompt chunk that stops short of the end samples nothing and needs no row): one row,
        plus one per draft the step verifies for it, each after the drafts before it."""
        requests = getattr(self.scheduler, "requests", {})
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        req_ids: list[str] = []
        grammars = []
        drafts: list[list[int]] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.structured_output is None:
                continue
            # schedule() counted this step's tokens as computed already.
            if request.num_computed_tokens < request.num_tokens:
                continue
            req_ids.append(req_id)
            grammars.append(request.structured_output)
            drafts.append(list(scheduled_drafts.get(req_id, ())) if scheduled_drafts else [])
        if grammars:
            scheduler_output.structured_output_request_ids = req_ids
            scheduler_output.grammar_bitmask = self._structured_output.fill_bitmask(grammars, drafts)
            for req_id, grammar in zip(req_ids, grammars):
                if grammar.error() is not None:  # its masks cost too much: failed at the next step
                    self._grammar_pending[req_id] = requests[req_id]

    # -- utilities (callable by name from the frontend) -------------------------------------
    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()  # AllBlocksCleared now, not at the next step
        return reset

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.kv_cache_manager.block_pool.take_events())

    def get_scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def get_kv_cache_info(self) -> dict[str, int]:
        return {"num_blocks": self.num_kv_blocks, "block_size": self.block_size,
                "num_free_blocks": self.kv_cache_manager.num_free_blocks}

    # Sleep mode (vLLM's sleep / wake_up / is_sleeping; sparrow.worker.sleep_mode): while any
    # tag sleeps, requests are refused.
    def sleep(self, level: int = 1) -> None:
        check_sleep(self.config, level)
        # Frozen (a pause's keep) and held requests count: they run again on resume.
        if self.scheduler.has_unfinished_requests() or self._in_flight or self.pause_state.held:
            num_requests = self.scheduler.get_num_unfinished_requests() + len(self.pause_state.held)
            raise ValueError(f"sleep: {num_requests} requests are in flight or held by a pause; "
                             "let them finish or abort them first")
        self.scheduler.reset_prefix_cache()  # the KV cache's contents are discarded
        self.executor.collective_rpc("sleep", (level,))
        self._sleeping_tags = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = check_wake_up_tags(tags)
        self.executor.collective_rpc("wake_up", (tags,))
        self._sleeping_tags -= set(SLEEP_TAGS if tags is None else tags)

    def is_sleeping(self) -> bool:
        return bool(self._sleeping_tags)

    # Pausing (vLLM's pause_generation, engine-core side; see sparrow.engine.core_pause).
    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        pause(self, mode, clear_cache)

    def resume_scheduler(self) -> None:
        resume(self)

    def is_scheduler_paused(self) -> bool:
        return self.pause_state.paused

    # For core_pause. Private: a utility call (EngineCoreProc refuses names with a leading "_")
    # cannot reach them.
    def _defer_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self._deferred.extend(outputs)

    def _take_deferred_outputs(self) -> EngineCoreOutputs | None:
        """The outputs made between steps, now (EngineCoreProc sends them before a utility call's
        answer, so that a caller of pause_generation has seen them when the call returns)."""
        if not self._deferred:
            return None
        outputs, self._deferred = self._deferred, []
        return self._outputs(outputs)

    def _finish_steps_in_flight(self) -> None:
        """Collect every step still running (overlapped scheduling); its outputs are deferred."""
        while self._in_flight:
            scheduler_output, future = self._in_flight.popleft()
            self._deferred.extend(self.scheduler.update_from_output(scheduler_output, future.result()))

    def collective_rpc(self, method: str | bytes, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        # timeout_s only when asked for: an executor plugin written before it existed still works.
        extra = {} if timeout is None else {"timeout_s": timeout}
        return self.executor.collective_rpc(method, tuple(args), kwargs, **extra)

    def profile(self, is_start: bool = True) -> list[Any]:
        """Start or stop every worker's profiler (sparrow.worker.profiler); stopping returns each
        rank's summary."""
        return self.executor.collective_rpc("start_profile" if is_start else "stop_profile")

    # LoRA adapters (vLLM's add_lora / remove_lora / list_loras): the workers load them ahead of
    # use, or forget them. Arguments are builtins: utility calls carry no Structs.
    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        from sparrow.lora.engine import check_lora_request
        from sparrow.lora.request import LoRARequest

        lora_request = LoRARequest(lora_name, lora_int_id, lora_path)
        check_lora_request(lora_request, self.config, self.lora_hf_config())
        return all(self.executor.collective_rpc("add_lora", (lora_name, lora_int_id, lora_path)))

    def lora_hf_config(self) -> Any:
        """The model's config, read once, to check adapters' tensor shapes before a worker loads them."""
        if getattr(self, "_lora_hf_config", None) is None:
            from sparrow.model_loader import model_hf_config

            self._lora_hf_config = model_hf_config(self.config.model)
        return self._lora_hf_config

    def remove_lora(self, lora_int_id: int) -> bool:
        return any(self.executor.collective_rpc("remove_lora", (lora_int_id,)))

    def list_loras(self) -> list[int]:
        return self.executor.collective_rpc("list_loras")[0] if self.config.lora.enable_lora else []

    def shutdown(self) -> None:
        if self._structured_output is not None:
            self._structured_output.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        self.executor.shutdown()

