"""LLM: vLLM's offline API. ``LLM(model=None, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sparrow.config import EngineConfig
from sparrow.engine.llm_engine import LLMEngine
from sparrow.outputs import RequestOutput
from sparrow.sampling_params import SamplingParams

ChatMessages = Sequence[Mapping[str, Any]]


class LLM:
    """An offline engine. ``model`` is a local Hugging Face directory; None (or "sparrow-tiny")
    is the built-in model, built locally on first use. Every engine argument of
    :class:`~sparrow.config.EngineConfig` is accepted as a keyword (``max_model_len``,
    ``max_num_seqs``, ``enable_prefix_caching``, ``scheduler``, ``device``, ``dtype``...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        multiprocess = kwargs.pop("multiprocess", None)
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(config, multiprocess=multiprocess)
        self._request_counter = itertools.count()

    # -- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``.
        """
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the tokenizer's
        chat template (with the generation prompt)."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        for index, conversation in enumerate(conversations):
            if not isinstance(conversation, Sequence) or not all(isinstance(m, Mapping) for m in conversation):
                raise ValueError(f"messages[{index}] must be a list of {{'role', 'content'}} dicts")
        return self._run(conversations, sampling_params, use_tqdm, None)

    def _run(self, prompts: list[Any], sampling_params: Any, use_tqdm: bool,
             priority: Sequence[int] | None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling_params; they must match")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities; they must match")

        engine = self.llm_engine
        # Validate every prompt before any reaches the engine: a bad one costs no other its work.
        processed = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = str(next(self._request_counter))
            processed.append(engine.process_request(request_id, prompt, params,
                                                    priority=priority[index] if priority else 0))
        order = {request.request_id: index for index, (_, request) in enumerate(processed)}
        for text, request in processed:
            engine.add_processed_request(text, request)
        return self._run_engine(order, use_tqdm)

    def _run_engine(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: list[RequestOutput | None] = [None] * len(order)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True,
                       postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        started = time.perf_counter()
        num_prompt_tokens = num_output_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    results[order[output.request_id]] = output
                    if bar is not None:
                        num_prompt_tokens += len(output.prompt_token_ids or ())
                        num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                        elapsed = max(time.perf_counter() - started, 1e-9)
                        bar.postfix = (f"est. speed input: {num_prompt_tokens / elapsed:.2f} toks/s, "
                                       f"output: {num_output_tokens / elapsed:.2f} toks/s")
                        bar.update(1)
        except BaseException:
            # Interrupted (e.g. Ctrl-C): leave the engine clean for the next call.
            engine.abort_request(list(order))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    # -- utilities --------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def num_parameters(self) -> int:
        return self.llm_engine.collective_rpc("num_parameters")[0]

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self.llm_engine.collective_rpc(method, args)

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
