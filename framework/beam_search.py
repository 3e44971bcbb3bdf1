"""Beam search for ``LLM.beam_search`` (vLLM's offline beam search, same results and types) and,
through ``BeamSearchState``, for ``AsyncLLM.beam_search`` (sparrow.engine.async_beam_search).

Each step asks the engine for one token of every live beam, with the top ``2 * beam_width``
logprobs (``SamplingParams(max_tokens=1, logprobs=2 * beam_width)``): a beam's prompt is its
tokens so far, so the prefix cache serves what earlier steps computed. Every candidate token
extends its beam; a candidate that is an end-of-sequence token (unless ``ignore_eos``) finishes
that beam, the others compete, and the ``beam_width`` best by cumulative logprob go on. At the end
the finished and live beams are ranked by ``cum_logprob / length ** length_penalty`` (length: all
tokens, prompt included, a final EOS not; vLLM's and HF transformers' score) and the best
``beam_width`` are returned. ``BeamSearchState`` holds a prompt's bookkeeping of those steps, the
one implementation both paths use; they differ only in how they ask the engine for the tokens.

As in vLLM, ``BeamSearchSequence.tokens`` holds the prompt's tokens followed by the generated ones
and ``text`` decodes all of them. A beam that reaches ``max_model_len`` ends there
(``finish_reason="length"``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparrow.errors import InvalidArgumentError
from sparrow.outputs import Logprob
from sparrow.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from sparrow.engine.input_processor import InputProcessor
    from sparrow.entrypoints.llm import LLM

# The keys of vLLM's TextPrompt and TokensPrompt, the prompt dicts LLM.beam_search takes.
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` (prompt then generated), the candidate logprobs of each generated
    position, and its cumulative logprob."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS token) or "length"
    stop_reason: int | None = None  # the EOS token id that ended it


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: Sequence[int], cum_logprob: float, eos_token_ids: frozenset[int],
                      length_penalty: float) -> float:
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    try:
        denominator = max(length, 1) ** length_penalty
    except OverflowError:  # an enormous length_penalty: the score is 0 (or -0.0)
        denominator = math.inf
    if denominator == 0.0:  # an enormous negative one underflows: every imperfect sequence is -inf
        return -math.inf if cum_logprob < 0 else 0.0
    return cum_logprob / denominator


@dataclass
class BeamSearchState:
    """One prompt's search: its live ``beams`` and the ``completed`` ones. The bookkeeping of a
    step, shared by ``LLM.beam_search`` and ``AsyncLLM.beam_search``: ``end_full_beams``, then the
    engine computes one token of every live beam, then ``advance``; at the end ``best``."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)

    def end_full_beams(self, max_model_len: int) -> None:
        """A beam with no room left under ``max_model_len`` ends here."""
        full = [beam for beam in self.beams if len(beam.tokens) >= max_model_len]
        if full:
            self.completed.extend(full)
            self.beams = [beam for beam in self.beams if len(beam.tokens) < max_model_len]

    def advance(self, step_logprobs: Sequence[dict[int, Logprob] | None], params: BeamSearchParams,
                eos: frozenset[int]) -> None:
        """Extend ``beams[i]`` by every candidate of ``step_logprobs[i]`` (its top logprobs this
        step; None or empty: no candidates): an EOS candidate (unless ``ignore_eos``) completes
        its beam, the ``beam_width`` best others by cumulative logprob are the new live beams."""
        candidates: list[BeamSearchSequence] = []
        for beam, logprobs in zip(self.beams, step_logprobs):
            position = logprobs or {}
            for token_id, logprob in position.items():
                if math.isinf(logprob.logprob):
                    continue  # a token the model cannot produce
                extended = BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [position],
                                              lora_request=beam.lora_request,
                                              cum_logprob=beam.cum_logprob + logprob.logprob)
                if token_id in eos and not params.ignore_eos:
                    extended.finish_reason, extended.stop_reason = "stop", token_id
                    self.completed.append(extended)
                else:
                    candidates.append(extended)
        self.beams = sorted(candidates, key=lambda beam: beam.cum_logprob, reverse=True)[:params.beam_width]

    def best(self, params: BeamSearchParams, eos: frozenset[int]) -> list[BeamSearchSequence]:
        """The ``beam_width`` best of the completed and live beams by ``beam_search_score``, best
        first; a beam that did not stop has finish_reason "length"."""
        self.completed.extend(self.beams)
        self.beams = []
        best = sorted(self.completed, reverse=True,
                      key=lambda beam: beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty))
        for beam in best[:params.beam_width]:
            if beam.finish_reason is None:
                beam.finish_reason = "length"
        return best[:params.beam_width]


def shown_tokens(beam: BeamSearchSequence, params: BeamSearchParams, start: int = 0) -> list[int]:
    """The tokens of ``beam`` from ``start`` that its text shows: a final EOS only with
    ``include_stop_str_in_output``."""
    tokens = beam.tokens[start:]
    if beam.stop_reason is not None and not params.include_stop_str_in_output and tokens:
        tokens = tokens[:-1]
    return tokens


def beam_text(tokenizer: Any, beam: BeamSearchSequence, params: BeamSearchParams, start: int = 0,
              decode_options: Mapping[str, Any] | None = None) -> str:
    """The text of ``beam`` from ``start``: its ``shown_tokens`` decoded, with ``decode_options``
    (the tokenizer's ``decode`` keywords, e.g. the server's ``skip_special_tokens``; None: its
    defaults). The one decoding of a beam, for ``LLM.beam_search``, ``AsyncLLM.beam_search`` and
    the server's ``use_beam_search``. Without a tokenizer (skip_tokenizer_init) the text is "", as
    an ordinary request's is."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(shown_tokens(beam, params, start), **(decode_options or {}))


def check_beam_width(params: BeamSearchParams, max_logprobs: int) -> int:
    """The logprobs a step asks for (``2 * beam_width``); a ValueError naming ``beam_width`` when
    that exceeds ``max_logprobs`` or ``params`` is not a BeamSearchParams."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidArgumentError(f"params must be a BeamSearchParams, got {type(params).__name__}", "params")
    num_logprobs = 2 * params.beam_width
    if num_logprobs > max_logprobs:
        raise InvalidArgumentError(
            f"beam_width={params.beam_width} needs {num_logprobs} logprobs per step, more than max_logprobs="
            f"{max_logprobs}; lower beam_width or raise the engine argument max_logprobs", "beam_width")
    return num_logprobs


def step_sampling_params(params: BeamSearchParams, num_logprobs: int) -> SamplingParams:
    """A step's request for one beam: one token and the top ``num_logprobs`` logprobs."""
    return SamplingParams(max_tokens=1, logprobs=num_logprobs, temperature=params.temperature, detokenize=False)


def search_prompt(processor: InputProcessor, request_id: str, prompt: Any, step_params: SamplingParams,
                  priority: int = 0) -> tuple[str | None, list[int]]:
    """The text (None for a token prompt) and token ids a search of ``prompt`` starts from, read
    and checked by the engine's own prompt handling as ``generate`` reads and checks a prompt
    (its forms, empty, outside the vocabulary, no room under max_model_len), before any step
    runs; errors name ``request_id``."""
    text, request = processor.process_inputs(request_id, prompt, step_params, priority=priority)
    return text, list(request.prompt_token_ids)


def _prompt_token_ids(processor: InputProcessor, index: int, prompt: Any, step_params: SamplingParams) -> list[int]:
    """``prompts[index]``'s token ids (``search_prompt``). ``LLM.beam_search`` takes vLLM's forms
    only, a string or a dict of prompt and/or prompt_token_ids: anything else is refused naming
    ``prompts[index]``."""
    where = f"prompts[{index}]"
    if not isinstance(prompt, (str, Mapping)):
        raise InvalidArgumentError(f"{where} must be a string or a dict with prompt or prompt_token_ids, got "
                                   f"{type(prompt).__name__}", where)
    unknown = set(prompt) - _PROMPT_KEYS if isinstance(prompt, Mapping) else set()
    if unknown:
        raise InvalidArgumentError(f"{where}: keys {sorted(unknown, key=str)} are not supported; a prompt dict "
                                   "takes prompt or prompt_token_ids", where)
    return search_prompt(processor, where, prompt, step_params)[1]


def beam_search(llm: LLM, prompts: Sequence[Any], params: BeamSearchParams, lora_request: Any = None,
                use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """The body of ``LLM.beam_search``; see the module docstring."""
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    engine = llm.llm_engine
    num_logprobs = check_beam_width(params, engine.input_processor.max_logprobs)
    if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int)
                                          or concurrency_limit < 1):
        raise InvalidArgumentError(f"concurrency_limit must be a positive integer or None, got {concurrency_limit!r}",
                                   "concurrency_limit")
    from sparrow.lora.engine import lora_requests_per_prompt

    loras = lora_requests_per_prompt(lora_request, len(prompts))
    step_params = step_sampling_params(params, num_logprobs)
    states = []
    for index, (prompt, lora) in enumerate(zip(prompts, loras)):
        # Every prompt is checked before any search starts.
        token_ids = _prompt_token_ids(engine.input_processor, index, prompt, step_params)
        states.append(BeamSearchState([BeamSearchSequence(tokens=token_ids, lora_request=lora)]))
    eos = frozenset(engine.input_processor.eos_token_ids)
    max_model_len = engine.config.model.max_model_len or 0
    limit = concurrency_limit or max(len(states), 1)
    batches = [states[start:start + limit] for start in range(0, len(states), limit)]
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batches) * params.max_tokens, desc="Beam search", unit="step")
    try:
        for batch in batches:
            for _ in range(params.max_tokens):
                extended = _step(llm, batch, step_params, params, eos, max_model_len)
                if bar is not None:
                    bar.update()
                if not extended:
                    break
    finally:
        if bar is not None:
            bar.close()
    tokenizer = engine.tokenizer
    outputs = []
    for state in states:
        best = state.best(params, eos)
        for beam in best:
            beam.text = beam_text(tokenizer, beam, params)
        outputs.append(BeamSearchOutput(best))
    return outputs


def _step(llm: LLM, batch: list[BeamSearchState], step_params: SamplingParams, params: BeamSearchParams,
          eos: frozenset[int], max_model_len: int) -> bool:
    """Extend every live beam of ``batch`` by one token; False when no beam is left to extend."""
    for state in batch:
        state.end_full_beams(max_model_len)
    live = [beam for state in batch for beam in state.beams]
    if not live:
        return False
    results = llm._run([{"prompt_token_ids": beam.tokens} for beam in live], step_params, use_tqdm=False,
                       priority=None, lora_request=[beam.lora_request for beam in live])
    start = 0
    for state in batch:
        count = len(state.beams)
        state.advance([logprobs[0] if (logprobs := result.outputs[0].logprobs) else None
                       for result in results[start:start + count]], params, eos)
        start += count
    return True
