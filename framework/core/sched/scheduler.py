"""The default scheduling machinery: token budget, chunked prefill, preemption, allocation.

A policy (fcfs, priority, sjf, lpm in ``sparrow_schedulers``, or a third party's) subclasses
:class:`Scheduler` and overrides only its ordering decisions: :meth:`Scheduler.waiting_key`
(which waiting request is admitted first) and :meth:`Scheduler.victim_key` (which running request
is preempted first); one that needs more replaces a phase of ``schedule()`` (``_schedule_running``,
``_schedule_waiting``, ``_build_output``), which share the step's :class:`StepPlan`. Pure Python:
no torch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from sparrow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from sparrow.core.request import Request, RequestStatus
from sparrow.core.sched.interface import SchedulerInterface
from sparrow.core.sched.plan import AllocateFn, StepPlan, allocate_directly
from sparrow.core.sched.spec import SpecDecodeStats
from sparrow.core.sched.update import StepOutputs
from sparrow.errors import InvalidArgumentError
from sparrow.wire import CachedRequestData, NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

class Scheduler(StepOutputs, SchedulerInterface):
    """Running requests are served first, then waiting ones, until the token budget is spent.

    Subclasses set ``sort_waiting = True`` and override :meth:`waiting_key` to reorder admission;
    the base order is arrival, with preempted requests back at the head.
    """

    sort_waiting = False
    # Whether the policy reads Request.priority. Under one that does not, the frontend refuses a
    # request with a non-zero priority (vLLM's rule) rather than let it be silently ignored.
    uses_priority = False
    # LoRA (set by the engine core when enable_lora): at most this many distinct adapters among
    # the running requests; a waiting request whose adapter would be one too many waits (vLLM's rule).
    max_loras: int | None = None
    # Overlapped scheduling (set by the engine core when async_scheduling): a step is scheduled
    # before the previous one's tokens are back. Each token a running step will sample counts as
    # a placeholder (``Request.num_output_placeholders``) until update_from_output sees it.
    async_scheduling = False

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int | None = None,
        allocate_slots: AllocateFn | None = None,
        kv_connector: Any = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self._allocate = allocate_slots or allocate_directly
        # Scheduler half of a KV connector (sparrow.kv_transfer), or None.
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.kv_cache_manager = kv_cache_manager
        # Cumulative counters for make_stats(), never reset.
        self.num_external_computed_tokens = 0  # tokens loaded through the connector
        self.num_preemptions = 0
        # Speculative decoding (sparrow.core.sched.spec): req_id -> drafts the workers proposed
        # for its next step; empty whenever speculation is off.
        self.draft_token_ids: dict[str, list[int]] = {}
        self.spec_decode_stats = SpecDecodeStats()

        self.requests: dict[str, Request] = {}  # req_id -> request, every unfinished one
        self.num_structured_requests = 0  # of them, those with a grammar (overlap waits for them)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        # Finished or preempted since the last schedule(): the workers must drop their state.
        self.finished_req_ids: set[str] = set()

    # -- ordering decisions (the part a policy overrides) -----------------------------------
    def waiting_key(self, request: Request) -> Any:
        """Sort key for admission when ``sort_waiting``; smallest first."""
        return request.arrival_time

    def victim_key(self, request: Request) -> Any:
        """The running request with the largest key is preempted first (FCFS: latest arrival)."""
        return request.arrival_time

    # -- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        needed = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        if not self.kv_cache_manager.can_fit(needed):
            capacity = self.kv_cache_manager.num_blocks * self.kv_cache_manager.block_size
            # Blame max_tokens when the prompt alone (and one output token) would fit.
            culprit = "max_tokens" if self.kv_cache_manager.can_fit(request.num_prompt_tokens + 1) else "prompt"
            raise InvalidArgumentError(
                f"request {request.request_id!r} needs KV cache for {needed} tokens "
                f"(prompt {request.num_prompt_tokens} + max_tokens {request.max_tokens}) but the "
                f"whole cache holds {capacity} tokens; lower max_tokens or raise "
                f"kv_cache_memory_bytes / num_kv_blocks", culprit,
            )
        if not self.enable_chunked_prefill and request.num_prompt_tokens > self.max_num_batched_tokens:
            raise InvalidArgumentError(
                f"request {request.request_id!r} has {request.num_prompt_tokens} prompt tokens, more "
                f"than max_num_batched_tokens={self.max_num_batched_tokens} with chunked prefill off", "prompt",
            )
        if request.request_id in self.requests:
            raise InvalidArgumentError(f"request_id {request.request_id!r} is already in use", "request_id")
        self.requests[request.request_id] = request
        self.num_structured_requests += request.structured_output is not None
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free(request)

    def _free(self, request: Request) -> None:
        self.draft_token_ids.pop(request.request_id, None)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.num_structured_requests -= request.structured_output is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # -- the decision -----------------------------------------------------------------------
    def _cap(self, request: Request, num_new_tokens: int, token_budget: int) -> int:
        threshold = self.long_prefill_token_threshold
        if threshold is not None and num_new_tokens > threshold:
            num_new_tokens = threshold
        return min(num_new_tokens, token_budget)

    def _allocate_for(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                      new_computed_blocks: KVCacheBlocks | None = None) -> KVCacheBlocks | None:
        return self._allocate(
            kv_cache_manager=self.kv_cache_manager, request=request, num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_new_computed_tokens, new_computed_blocks=new_computed_blocks,
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        self.draft_token_ids.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(request.request_id)  # workers forget it until it resumes
        self.waiting.appendleft(request)

    def preempt_running(self) -> None:
        """Preempt every running request, keeping their order at the head of the queue: they
        recompute their KV when they run again (``pause_generation(mode="keep", clear_cache=True)``:
        that KV came from weights about to change)."""
        for request in reversed(list(self.running)):
            self._preempt(request)

    def schedule(self) -> SchedulerOutput:
        """Three phases: running requests first, in admission order; then waiting ones, unless
        memory ran out; then the message for the workers. Subclasses may override a phase."""
        plan = StepPlan(token_budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Give each running request its next tokens, preempting (``victim_key``) when the KV
        cache is full."""
        index = 0
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            placeholders = request.num_output_placeholders
            if placeholders and (request.num_output_tokens + placeholders >= request.max_tokens
                                 or request.num_tokens + placeholders >= self.max_model_len):
                index += 1  # the token in flight is its last: nothing more to schedule
                continue
            num_new_tokens = request.num_tokens + placeholders - request.num_computed_tokens
            drafts = self.draft_token_ids.pop(request.request_id, None) if self.draft_token_ids else None
            if drafts:
                num_new_tokens += len(drafts)  # 1 + k tokens and KV slots
            num_new_tokens = self._cap(request, num_new_tokens, plan.token_budget)
            if num_new_tokens <= 0:
                index += 1
                continue
            while True:
                new_blocks = self._allocate_for(request, num_new_tokens)
                if new_blocks is not None:
                    break
                victim = max(self.running, key=self.victim_key)
                plan.preempted = True
                if victim.request_id in plan.num_scheduled_tokens:
                    # Already scheduled this step: give its budget back.
                    plan.token_budget += plan.num_scheduled_tokens.pop(victim.request_id)
                    plan.new_block_ids.pop(victim.request_id, None)
                    plan.new_extra_block_ids.pop(victim.request_id, None)
                    plan.spec_decode_tokens.pop(victim.request_id, None)
                    plan.scheduled_running.remove(victim)
                if self.running.index(victim) < index:
                    index -= 1
                self._preempt(victim)
                if victim is request:
                    break
            if new_blocks is None:
                continue  # the request itself was preempted; running[index] is the next one
            plan.scheduled_running.append(request)
            plan.num_scheduled_tokens[request.request_id] = num_new_tokens
            plan.new_block_ids[request.request_id] = new_blocks.get_block_ids()
            if new_blocks.extra_groups is not None:
                plan.new_extra_block_ids[request.request_id] = new_blocks.get_extra_group_block_ids()
            plan.token_budget -= num_new_tokens
            if drafts:
                # The budget may have cut the drafts short: keep those that fit.
                num_drafts = request.num_computed_tokens + num_new_tokens - request.num_tokens
                if num_drafts > 0:
                    plan.spec_decode_tokens[request.request_id] = drafts[:num_drafts]
            index += 1

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests (``waiting_key`` order when ``sort_waiting``) while the budget,
        ``max_num_seqs`` and the KV cache allow, starting each at its longest cached prefix."""
        if self.sort_waiting and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self.waiting_key))
        # Requests whose grammar is still compiling step aside for this step, keeping their
        # place in the queue, so that they block nobody.
        skipped: list[Request] = []
        # lora_int_id of every running request's adapter (LoRA engines only)
        active_loras = ({r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
                        if self.max_loras is not None else set())
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                if not request.structured_output.is_ready():
                    skipped.append(self.waiting.popleft())
                    continue
                request.status = RequestStatus.WAITING
            if request.num_output_placeholders:
                # Preempted while its last step ran: it resumes once that step's token is back.
                skipped.append(self.waiting.popleft())
                continue
            lora = request.lora_request
            if (lora is not None and self.max_loras is not None and lora.lora_int_id not in active_loras
                    and len(active_loras) >= self.max_loras):
                skipped.append(self.waiting.popleft())  # its adapter waits for a free slot
                continue
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request, record_stats=False)
            num_external = 0
            if self.kv_connector is not None:
                num_external = self.kv_connector.get_num_new_matched_tokens(request, num_computed)
            num_new_tokens = request.num_tokens - num_computed - num_external
            if not self.enable_chunked_prefill and num_new_tokens > plan.token_budget:
                break
            num_new_tokens = self._cap(request, num_new_tokens, plan.token_budget)
            # Externally loaded tokens need slots but no compute budget.
            new_blocks = self._allocate_for(request, num_new_tokens + num_external, num_computed, computed_blocks)
            if new_blocks is None:
                break
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_blocks(request.request_id), num_external)
                self.num_external_computed_tokens += num_external
            if self.kv_cache_manager.enable_caching:
                self.kv_cache_manager.prefix_cache_stats.record(request.num_tokens, num_computed)
            self.waiting.popleft()
            self.running.append(request)
            if lora is not None and self.max_loras is not None:
                active_loras.add(lora.lora_int_id)
            request.status = RequestStatus.RUNNING
            num_computed += num_external
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            plan.scheduled_new.append(request)
            plan.num_scheduled_tokens[request.request_id] = num_new_tokens
            plan.token_budget -= num_new_tokens
        self.waiting.extendleft(reversed(skipped))

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        """The step's message for the workers; afterwards the scheduled tokens count as computed."""
        output = SchedulerOutput(
            scheduled_new_reqs=[self._new_request_data(r) for r in plan.scheduled_new],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in plan.scheduled_running],
                new_block_ids=[plan.new_block_ids[r.request_id] for r in plan.scheduled_running],
                num_computed_tokens=[r.num_computed_tokens for r in plan.scheduled_running],
                new_extra_group_block_ids=[plan.new_extra_block_ids[r.request_id] for r in plan.scheduled_running]
                if plan.new_extra_block_ids else [],
            ),
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - plan.token_budget,
            finished_req_ids=sorted(self.finished_req_ids),
        )
        if plan.spec_decode_tokens:
            output.scheduled_spec_decode_tokens = plan.spec_decode_tokens
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output, self.requests)
        self.finished_req_ids = set()
        # The tokens are as good as computed once scheduled: the next step builds on them.
        for req_id, num_new_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_new_tokens
            if self.async_scheduling and \
                    request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # the step samples its next token
        return output

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
            extra_group_block_ids=self.kv_cache_manager.get_extra_group_block_ids(request.request_id),
            lora_request=request.lora_request,
            cache_salt=request.cache_salt,
            pooling_task=request.pooling_task,
            prompt_embeds=request.prompt_embeds,
        )
