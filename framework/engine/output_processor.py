"""Frontend (P0) output side: ``EngineCoreOutput`` -> ``RequestOutput``.

Per request it keeps the detokenizer, the token ids and logprobs so far, and timing. It finds stop
strings (the engine core only sees token ids, so it must be told to abort those requests) and joins
the ``n`` child requests of a parallel-sampling request back into one ``RequestOutput``.
EOS, stop token ids and max_tokens are decided by the engine core and arrive as finish_reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from sparrow.core.request import FinishReason
from sparrow.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from sparrow.engine.messages import EngineCoreOutput, EngineCoreRequest
from sparrow.engine.parallel_sampling import make_child_requests
from sparrow.engine.pooling_io import pooled_output
from sparrow.errors import InvalidArgumentError
from sparrow.logprobs import FlatLogprobs, append_logprobs
from sparrow.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from sparrow.sampling_params import RequestOutputKind


class OutputQueue(Protocol):
    """Where an asynchronous caller wants its request's outputs (e.g. an asyncio queue wrapper)."""

    def put(self, output: RequestOutput) -> None: ...


@dataclass(slots=True)
class ProcessedOutputs:
    # Outputs of requests that have no queue, at most one per request, in arrival order.
    request_outputs: list[RequestOutput]
    # Engine-core request ids that hit a stop string: the engine core must abort them.
    reqs_to_abort: list[str]


@dataclass(slots=True)
class ParentRequest:
    """A request with n > 1 samples, fanned out into n child requests in the engine core."""

    request_id: str
    output_kind: RequestOutputKind
    # child request id -> index of its CompletionOutput
    child_indexes: dict[str, int]
    unfinished_children: set[str]
    # index -> latest CompletionOutput (CUMULATIVE) or final one (FINAL_ONLY)
    completions: dict[int, CompletionOutput] = field(default_factory=dict)


@dataclass(slots=True)
class RequestState:
    """Everything the frontend remembers about one engine-core request."""

    request_id: str
    # The id the caller knows: the parent's for a child of an n > 1 request.
    external_id: str
    index: int
    parent: ParentRequest | None
    prompt: str | None
    # None for a prompt given as embeddings (vLLM's): its ids in the engine core are placeholders.
    prompt_token_ids: list[int] | None
    num_prompt_tokens: int
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer | None
    # The token decoder for logprob texts; None when the request does not detokenize.
    logprob_decoder: TokenDecoder | None
    metrics: RequestMetrics
    queue: OutputQueue | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # Position 0 is None; position i is the distribution that predicted prompt token i.
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    # DELTA mode: how much has been handed out already.
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    num_sent_prompt_logprobs: int = 0
    # stream_interval: an unfinished output waits for this many new tokens (but the first one),
    # counted from the output tokens there were at the last output.
    stream_interval: int = 1
    num_tokens_at_last_output: int = 0
    lora_request: Any = None  # the request's LoRA adapter, echoed in every RequestOutput
    pooling: Any = None  # a pooling model's request: its resolved PoolingParams (no tokens, one vector)

    def record_logprobs(self, output: EngineCoreOutput) -> None:
        if output.new_prompt_logprobs and self.prompt_logprobs is not None:
            for entry in output.new_prompt_logprobs:
                append_logprobs(self.prompt_logprobs, entry, self.logprob_decoder)
        if output.new_logprobs and self.logprobs is not None:
            cumulative = self.cumulative_logprob or 0.0
            for entry in output.new_logprobs:
                append_logprobs(self.logprobs, entry, self.logprob_decoder)
                cumulative += entry.logprobs[0]
            self.cumulative_logprob = cumulative

    def record_token_times(self, num_new_tokens: int, now: float) -> None:
        if num_new_tokens == 0:
            return
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.metrics.num_generation_tokens += num_new_tokens

    def make_completion(self, finish_reason: FinishReason | None, stop_reason: int | str | None) -> CompletionOutput:
        finished = finish_reason is not None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta) if self.detokenizer is not None else ""
        # Slices are copies: the caller keeps outputs while this state keeps growing.
        token_ids = self.token_ids[self.num_sent_tokens:] if delta else self.token_ids[:]
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[self.num_sent_logprobs:] if delta else self.logprobs[:]
        if delta:
            self.num_sent_tokens = len(self.token_ids)
            self.num_sent_logprobs = len(self.logprobs or ())
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
        )

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        if self.prompt_logprobs is None or self.output_kind != RequestOutputKind.DELTA:
            # Complete by the first output token (prefill is over) and not extended afterwards.
            return self.prompt_logprobs
        unsent = self.prompt_logprobs[self.num_sent_prompt_logprobs:]
        self.num_sent_prompt_logprobs = len(self.prompt_logprobs)
        return unsent


class OutputProcessor:
    """Owns the frontend's view of every unfinished request. Called by LLM/AsyncLLM: ``add_request``
    when a request is submitted, ``process_outputs`` for every batch the engine core sends,
    ``abort_requests`` when the caller gives up on requests."""

    def __init__(self, tokenizer: Any, pooling: Any = None, stream_interval: int = 1) -> None:
        self._decoder = TokenDecoder.from_tokenizer(tokenizer) if tokenizer is not None else None
        self._pooling = pooling  # a pooling model's sparrow.engine.pooling_io.PoolingIO, else None
        # vLLM's stream_interval: an unfinished request's output waits until it has this many new
        # tokens, except its first token (time to first token is not delayed); a request's own
        # SamplingParams.stream_interval may raise it.
        self._stream_interval = stream_interval
        # engine-core request id -> state
        self._states: dict[str, RequestState] = {}
        # parent request id -> parent, for requests with n > 1
        self._parents: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def unfinished_request_ids(self) -> set[str]:
        """The engine-core ids of every unfinished request (a child's, for n > 1)."""
        return set(self._states)

    def external_id_of(self, request_id: str) -> str | None:
        """The caller's id of an unfinished engine-core request (a child's parent), else None."""
        state = self._states.get(request_id)
        return state.external_id if state is not None else None

    def add_request(
        self, request: EngineCoreRequest, prompt: str | None, *, queue: OutputQueue | None = None
    ) -> list[EngineCoreRequest]:
        """Start tracking a request; return the requests to send to the engine core (the request
        itself, or its n children when sampling_params.n > 1). With ``queue``, the request's
        outputs are put there instead of being returned by ``process_outputs``."""
        children = make_child_requests(request)
        for request_id in {request.request_id, *(child.request_id for child in children)}:
            if request_id in self._states or request_id in self._parents:
                if request_id == request.request_id:
                    raise InvalidArgumentError(
                        f"request_id {request_id!r} is already in use by an unfinished request", "request_id")
                # A child of an n > 1 request is named "{index}_{request_id}" (as in vLLM).
                raise InvalidArgumentError(
                    f"request_id {request.request_id!r} with n={len(children)} needs the id {request_id!r} for one "
                    "of its samples, and an unfinished request already has it; choose another request_id",
                    "request_id")
        params = request.sampling_params
        parent = None
        if len(children) > 1:
            parent = ParentRequest(
                request_id=request.request_id,
                output_kind=params.output_kind,
                child_indexes={child.request_id: index for index, child in enumerate(children)},
                unfinished_children={child.request_id for child in children},
            )
            self._parents[request.request_id] = parent
        now = time.monotonic()
        for index, child in enumerate(children):
            self._states[child.request_id] = self._new_state(child, prompt, index, parent, queue, now)
        return children

    def _new_state(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        index: int,
        parent: ParentRequest | None,
        queue: OutputQueue | None,
        now: float,
    ) -> RequestState:
        params = request.sampling_params
        decoder = self._decoder if params.detokenize and request.pooling_params is None else None
        wants_logprobs = params.logprobs is not None
        return RequestState(
            request_id=request.request_id,
            external_id=parent.request_id if parent is not None else request.request_id,
            index=index,
            parent=parent,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids if request.prompt_embeds is None else None,
            num_prompt_tokens=len(request.prompt_token_ids),
            output_kind=params.output_kind,
            detokenizer=(
                IncrementalDetokenizer.from_sampling_params(
                    decoder, params, request.prompt_token_ids if request.prompt_embeds is None else None)
                if decoder is not None
                else None
            ),
            logprob_decoder=decoder,
            metrics=RequestMetrics(arrival_time=request.arrival_time or now),
            queue=queue,
            logprobs=(FlatLogprobs() if params.flat_logprobs else []) if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
            prompt_logprobs=((FlatLogprobs([None]) if params.flat_logprobs else [None])
                             if params.prompt_logprobs is not None else None),
            lora_request=request.lora_request,
            pooling=request.pooling_params,
            stream_interval=max(self._stream_interval, params.stream_interval or 1),
        )

    # -- outputs ----------------------------------------------------------------------------
    def process_outputs(
        self, engine_core_outputs: list[EngineCoreOutput], timestamp: float | None = None
    ) -> ProcessedOutputs:
        """Apply one batch of engine-core outputs. ``timestamp`` (time.monotonic()) defaults to now."""
        now = time.monotonic() if timestamp is None else timestamp
        # external request id -> its output of this batch (children of one parent are merged)
        collected: dict[str, RequestOutput] = {}
        queues: dict[str, OutputQueue | None] = {}
        reqs_to_abort: list[str] = []
        for engine_core_output in engine_core_outputs:
            state = self._states.get(engine_core_output.request_id)
            if state is None:
                continue  # aborted by the caller while the engine core was still working on it
            output, stopped_by_string = self._process_one(state, engine_core_output, now)
            if stopped_by_string:
                reqs_to_abort.append(state.request_id)
            if output is not None:
                self._collect(collected, queues, state, output)
        request_outputs = []
        for external_id, output in collected.items():
            queue = queues[external_id]
            if queue is not None:
                queue.put(output)
            else:
                request_outputs.append(output)
        return ProcessedOutputs(request_outputs=request_outputs, reqs_to_abort=reqs_to_abort)

    def _process_one(
        self, state: RequestState, engine_core_output: EngineCoreOutput, now: float
    ) -> tuple[RequestOutput | None, bool]:
        new_token_ids = engine_core_output.new_token_ids
        finish_reason = engine_core_output.finish_reason
        stop_reason = engine_core_output.stop_reason
        state.num_cached_tokens = max(state.num_cached_tokens, engine_core_output.num_cached_tokens)
        if state.pooling is not None:  # one output, with the vector, when the prompt is done
            if finish_reason is None:
                return None, False
            state.metrics.finished_time = now
            self._forget(state)
            activation = self._pooling.activation(state.pooling) if self._pooling is not None else None
            return pooled_output(state.external_id, engine_core_output.pooling_output, state.pooling, state.prompt,
                                 state.prompt_token_ids, state.num_cached_tokens,
                                 activation), False  # type: ignore[return-value]
        state.record_token_times(len(new_token_ids), now)
        state.record_logprobs(engine_core_output)
        state.token_ids.extend(new_token_ids)

        stopped_by_string = False
        if state.detokenizer is not None:
            stop_string = state.detokenizer.update(
                new_token_ids,
                finished=finish_reason is not None,
                stop_terminated=finish_reason == FinishReason.STOP,
            )
            if stop_string is not None:
                # Only a request the engine core still runs needs aborting.
                stopped_by_string = finish_reason is None
                finish_reason, stop_reason = FinishReason.STOP, stop_string

        finished = finish_reason is not None
        if finished:
            state.metrics.finished_time = now
            self._forget(state)
        elif not new_token_ids:
            return None, False  # e.g. a prefill chunk that only carried prompt logprobs
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None, stopped_by_string
        if (not finished and state.num_tokens_at_last_output
                and len(state.token_ids) - state.num_tokens_at_last_output < state.stream_interval):
            return None, stopped_by_string  # stream_interval: too few new tokens yet
        state.num_tokens_at_last_output = len(state.token_ids)
        completion = state.make_completion(finish_reason, stop_reason)
        return self._make_request_output(state, completion, finished), stopped_by_string

    def _make_request_output(
        self, state: RequestState, completion: CompletionOutput, finished: bool
    ) -> RequestOutput | None:
        parent = state.parent
        if parent is None:
            completions = [completion]
        else:
            if finished:
                parent.unfinished_children.discard(state.request_id)
            finished = not parent.unfinished_children
            if parent.output_kind == RequestOutputKind.DELTA:
                completions = [completion]
            else:
                parent.completions[completion.index] = completion
                if parent.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                    return None  # FINAL_ONLY: one output, once every child is done
                completions = [parent.completions[index] for index in sorted(parent.completions)]
        return RequestOutput(
            request_id=state.external_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.take_prompt_logprobs(),
            num_prompt_tokens=state.num_prompt_tokens,
            outputs=completions,
            finished=finished,
            metrics=state.metrics.snapshot(),
            lora_request=state.lora_request,
            num_cached_tokens=state.num_cached_tokens,
        )

    @staticmethod
    def _collect(
        collected: dict[str, RequestOutput],
        queues: dict[str, OutputQueue | None],
        state: RequestState,
        output: RequestOutput,
    ) -> None:
        earlier = collected.get(state.external_id)
        if earlier is None:
            collected[state.external_id] = output
            queues[state.external_id] = state.queue
        else:
            # Two children of one parent in the same batch: one RequestOutput for the parent.
            earlier.add(output, aggregate=state.output_kind == RequestOutputKind.DELTA)

    def _forget(self, state: RequestState) -> None:
        self._states.pop(state.request_id, None)
        parent = state.parent
        if parent is not None and all(child_id not in self._states for child_id in parent.child_indexes):
            self._parents.pop(parent.request_id, None)

    # -- aborts -----------------------------------------------------------------------------
    def abort_requests(self, request_ids: list[str] | str) -> list[str]:
        """Stop tracking requests (caller ids, or engine-core child ids); return the engine-core
        ids the engine core must abort. A request with a queue gets a final output with
        finish_reason "abort" so that its consumer wakes up."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        engine_ids: list[str] = []
        for request_id in request_ids:
            parent = self._parents.get(request_id)
            if parent is not None:
                engine_ids.extend(child_id for child_id in parent.child_indexes if child_id in self._states)
            elif request_id in self._states:
                engine_ids.append(request_id)
        engine_ids = list(dict.fromkeys(engine_ids))
        aborted = [
            EngineCoreOutput(request_id=engine_id, new_token_ids=[], finish_reason=FinishReason.ABORT)
            for engine_id in engine_ids
        ]
        self.process_outputs(aborted)  # outputs of queue-less requests are dropped: nobody waits
        return engine_ids
