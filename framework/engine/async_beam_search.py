"""``AsyncLLM.beam_search`` (vLLM's ``EngineClient.beam_search``): beam search on the asyncio engine.

The search is ``sparrow.beam_search``'s (``BeamSearchState``: the same candidates, EOS handling,
``max_model_len`` ends and final ranking as ``LLM.beam_search``); here each step submits one
request per live beam (``max_tokens=1``, ``2 * beam_width`` logprobs, the beam's tokens as the
prompt, ids ``{request_id}-beam{step}-{i}``) with ``AsyncLLM.generate`` and awaits them together.
A consumer that is cancelled or closes the generator, or a beam request that fails, cancels every
beam request still running, and their ``generate`` aborts them in the engine core.

It yields one ``RequestOutput`` (``finished=True``): its ``outputs`` are the best ``beam_width``
beams, best first, as ``CompletionOutput``s of the generated tokens only (``token_ids`` with a
final EOS token, ``text`` without it unless ``include_stop_str_in_output``, decoded once with the
caller's ``decode_options``: ``sparrow.beam_search.beam_text``), with their
``cumulative_logprob``, the candidate logprobs of every step (``logprobs``), ``finish_reason``
"stop" (an EOS token, also ``stop_reason``) or "length".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any

from sparrow.beam_search import (
    BeamSearchSequence,
    BeamSearchState,
    beam_text,
    check_beam_width,
    search_prompt,
    step_sampling_params,
)
from sparrow.engine.async_inputs import check_request_fields
from sparrow.engine.input_processor import prompt_cache_salt
from sparrow.outputs import CompletionOutput, RequestOutput
from sparrow.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from sparrow.engine.async_llm import AsyncLLM


async def async_beam_search(engine: AsyncLLM, prompt: Any, request_id: str, params: BeamSearchParams,
                            lora_request: Any = None, *, priority: int = 0,
                            decode_options: Mapping[str, Any] | None = None
                            ) -> AsyncGenerator[RequestOutput, None]:
    """The body of ``AsyncLLM.beam_search``; see the module docstring. ``prompt`` as for
    ``generate``; an invalid one, or invalid ``params``, raises ValueError naming the field at the
    first iteration. ``decode_options``: the tokenizer's ``decode`` keywords for the beams' texts
    (the server's ``skip_special_tokens`` and ``spaces_between_special_tokens``; None: its defaults)."""
    num_logprobs = check_beam_width(params, engine.input_processor.max_logprobs)
    check_request_fields(request_id, prompt, None, priority, None, None, None,
                         engine.config.parallel.data_parallel_size)
    step_params = step_sampling_params(params, num_logprobs).clone(output_kind=RequestOutputKind.FINAL_ONLY)
    processor = engine.input_processor
    # The caller's request is checked as one: its id in the errors, its priority, its prompt.
    prompt_text, prompt_ids = await engine.run_input_work(search_prompt, processor, request_id, prompt, step_params,
                                                          priority)
    eos = frozenset(processor.eos_token_ids)
    # vLLM's cache_salt (checked with the prompt) keys every beam's request, as it keys the prompt's.
    cache_salt = prompt_cache_salt(request_id, prompt)
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    max_model_len = engine.model_config.max_model_len or 0
    state = BeamSearchState([BeamSearchSequence(tokens=prompt_ids, lora_request=lora_request)])
    for step in range(params.max_tokens):
        state.end_full_beams(max_model_len)
        if not state.beams:
            break
        results = await _one_token_each(engine, state.beams, step_params, f"{request_id}-beam{step}", priority,
                                        salt)
        state.advance([result.outputs[0].logprobs[0] if result.outputs and result.outputs[0].logprobs else None
                       for result in results], params, eos)
    best = state.best(params, eos)
    start = len(prompt_ids)
    texts = await engine.run_input_work(
        lambda: [beam_text(engine.tokenizer, beam, params, start, decode_options) for beam in best])
    outputs = [CompletionOutput(index=index, text=text, token_ids=beam.tokens[start:],
                                cumulative_logprob=beam.cum_logprob, logprobs=beam.logprobs,
                                finish_reason=beam.finish_reason, stop_reason=beam.stop_reason)
               for index, (beam, text) in enumerate(zip(best, texts))]
    yield RequestOutput(request_id=request_id, prompt=prompt_text, prompt_token_ids=list(prompt_ids),
                        prompt_logprobs=None, outputs=outputs, finished=True, lora_request=lora_request)


async def _one_token_each(engine: AsyncLLM, beams: list[BeamSearchSequence], step_params: SamplingParams,
                          id_prefix: str, priority: int, salt: Mapping[str, str]) -> list[RequestOutput]:
    """The final output of one request per beam (``{id_prefix}-{i}``), submitted together;
    ``salt``: the search's ``{"cache_salt": ...}``, or empty."""

    async def final(index: int, beam: BeamSearchSequence) -> RequestOutput:
        last = None
        async for output in engine.generate({"prompt_token_ids": beam.tokens, **salt}, step_params,
                                            f"{id_prefix}-{index}",
                                            lora_request=beam.lora_request, priority=priority):
            last = output
        assert last is not None
        return last

    tasks = [asyncio.create_task(final(index, beam)) for index, beam in enumerate(beams)]
    try:
        return await asyncio.gather(*tasks)
    finally:
        # A failed beam request or a cancelled consumer: the others are cancelled, which aborts
        # them (generate's cleanup), and awaited, so that none outlives the search.
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
