"""The scheduler's half after the forward: a step's sampled tokens applied to its requests (stop
checks, grammars, finished requests freed), drafts kept for the next step, and the stats snapshot.

:class:`StepOutputs` is a mixin of :class:`sparrow.core.sched.scheduler.Scheduler`, which holds
the state it reads and changes (``requests``, ``running``, ``waiting``, ``draft_token_ids``,
``kv_cache_manager``, the counters); split from it by idea, the scheduling half stays there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparrow.core.request import Request, RequestStatus
from sparrow.core.sched.spec import SpecDecodeStats, usable_drafts
from sparrow.core.sched.stop import advance_grammar, check_stop
from sparrow.wire import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats

if TYPE_CHECKING:
    from sparrow.core.kv_cache_manager import KVCacheManager


class StepOutputs:
    """What happens when a step's output is back (a mixin: see the module docstring)."""

    requests: dict[str, Request]
    running: list[Request]
    waiting: Any  # deque[Request], or a policy's own queue
    draft_token_ids: dict[str, list[int]]
    kv_cache_manager: KVCacheManager
    max_model_len: int
    num_preemptions: int
    num_external_computed_tokens: int
    spec_decode_stats: SpecDecodeStats

    def _free(self, request: Request) -> None:
        raise NotImplementedError

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        sampled = dict(zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids))
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        pooled = model_runner_output.pooler_output
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted while the step ran
            if pooled:
                vector = pooled.get(req_id)
                if vector is not None:  # a pooling model's request is done once its prompt is
                    request.status = RequestStatus.FINISHED_STOPPED
                    outputs.append(EngineCoreOutput(
                        request_id=req_id, new_token_ids=[], finish_reason=request.get_finish_reason(),
                        num_cached_tokens=request.num_cached_tokens or 0, pooling_output=vector))
                    self.running.remove(request)
                    self._free(request)
                    continue
            generated = sampled.get(req_id, ())
            if generated and request.num_output_placeholders:
                request.num_output_placeholders -= len(generated)
            if scheduled_drafts:
                drafts = scheduled_drafts.get(req_id)
                if drafts:
                    # The step computed the last token and the accepted drafts; the rejected
                    # ones' KV slots are written over by the next steps.
                    num_accepted = max(len(generated) - 1, 0)
                    request.num_computed_tokens -= len(drafts) - num_accepted
                    self.spec_decode_stats.observe(len(drafts), num_accepted)
            new_token_ids: list[int] = []
            for token_id in generated:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                status, stop_reason = check_stop(request, token_id, self.max_model_len)
                if status is None and request.structured_output is not None:
                    status = advance_grammar(request, token_id)
                if status is not None:
                    request.status, request.stop_reason = status, stop_reason
                    break
            new_logprobs = logprobs.get(req_id)
            if new_logprobs is not None:
                new_logprobs = new_logprobs[: len(new_token_ids)]
            new_prompt_logprobs = prompt_logprobs.get(req_id)
            finished = request.is_finished()
            if new_token_ids or finished or new_prompt_logprobs:
                outputs.append(EngineCoreOutput(
                    request_id=req_id, new_token_ids=new_token_ids, new_logprobs=new_logprobs,
                    new_prompt_logprobs=new_prompt_logprobs,
                    finish_reason=request.get_finish_reason(), stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                ))
            if finished:
                try:
                    self.running.remove(request)
                except ValueError:  # preempted while its step ran (overlapped scheduling)
                    self.waiting.remove(request)
                self._free(request)
        if model_runner_output.spec_token_ids:
            self._keep_drafts(model_runner_output)
        return outputs

    def _keep_drafts(self, model_runner_output: ModelRunnerOutput) -> None:
        """Hold the workers' drafts for each unfinished request's next step."""
        for req_id, drafts in zip(model_runner_output.req_ids, model_runner_output.spec_token_ids):
            if not drafts:
                continue
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            drafts = usable_drafts(request, drafts, self.max_model_len)
            if drafts:
                self.draft_token_ids[req_id] = drafts

    def make_stats(self) -> SchedulerStats:
        """A snapshot: gauges now, counters since the scheduler was built (nothing is reset)."""
        cache_stats = self.kv_cache_manager.make_prefix_cache_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage, prefix_cache_queries=cache_stats.queries,
            prefix_cache_hits=cache_stats.hits, num_preemptions=self.num_preemptions,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_total_blocks=self.kv_cache_manager.num_blocks,
            kv_connector_loaded_tokens=self.num_external_computed_tokens,
            spec_decode_num_drafts=self.spec_decode_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decode_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_decode_stats.num_accepted_tokens_per_pos),
        )
