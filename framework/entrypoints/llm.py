"""LLM: vLLM's offline API. ``LLM(model=None, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sparrow.config import EngineConfig
from sparrow.engine.async_inputs import request_params
from sparrow.engine.llm_engine import LLMEngine
from sparrow.entrypoints.llm_pooling import PoolingMethods
from sparrow.entrypoints.llm_pooling import prompt_list as _prompt_list
from sparrow.errors import InvalidArgumentError
from sparrow.outputs import RequestOutput
from sparrow.param_checks import INT64_MAX, INT64_MIN
from sparrow.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = Sequence[Mapping[str, Any]]



def _check_priority(index: int, value: Any) -> int:
    """priority[index] as an int the engine core carries (numpy integers accepted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"priority[{index}] must be a 64-bit integer, got {value!r}")
    return int(value)


class LLM(PoolingMethods):
    """An offline engine. ``model`` is a local Hugging Face directory; None (or "sparrow-tiny")
    is the built-in model, built locally on first use. Every engine argument of
    :class:`~sparrow.config.EngineConfig` is accepted as a keyword (``max_model_len``,
    ``max_num_seqs``, ``enable_prefix_caching``, ``scheduler``, ``device``, ``dtype``...).
    ``stat_loggers`` takes registered names and ``package.module:Class`` strings (an engine
    argument) and also stat logger classes or factories (``sparrow.engine.stat_loggers``).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        multiprocess = kwargs.pop("multiprocess", None)
        stat_loggers = kwargs.get("stat_loggers")
        objects = None
        if isinstance(stat_loggers, (list, tuple)) and not all(isinstance(item, str) for item in stat_loggers):
            objects = kwargs.pop("stat_loggers")  # classes and factories stay in this process
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(config, multiprocess=multiprocess, stat_loggers=objects)
        self._request_counter = itertools.count()

    # -- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``.
        ``sampling_params`` None means ``get_default_sampling_params()`` (the model's generation config),
        as does a None in a list of one per prompt.
        ``lora_request``: a :class:`~sparrow.lora.request.LoRARequest` for every prompt, or a list
        with one (or None, the base model) per prompt; needs ``enable_lora=True``.
        """
        return self._run(_prompt_list(prompts), sampling_params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the tokenizer's
        chat template; ``lora_request`` as in :meth:`generate`. As in vLLM: ``chat_template``
        replaces the tokenizer's, ``add_generation_prompt`` opens the assistant's turn,
        ``continue_final_message`` (with ``add_generation_prompt=False``) lets the model continue
        the last message, ``tools`` (JSON schemas) and ``chat_template_kwargs`` (e.g.
        ``{"enable_thinking": False}`` for Qwen3) reach the template, and
        ``chat_template_content_format`` ("auto", "string" or "openai") says whether a message's
        content reaches it as a string or as a list of parts (``sparrow.engine.chat_content``)."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        for index, conversation in enumerate(conversations):
            if not isinstance(conversation, Sequence) or not all(isinstance(m, Mapping) for m in conversation):
                raise ValueError(f"messages[{index}] must be a list of {{'role', 'content'}} dicts")
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("continue_final_message", continue_final_message)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        processor = self.llm_engine.input_processor
        prompts = []
        for conversation in conversations:
            text = processor.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template, tools=tools,
                chat_template_kwargs=chat_template_kwargs, content_format=chat_template_content_format)
            # The template wrote every special token the model expects: none are added.
            prompts.append({"prompt": text, "prompt_token_ids": processor.tokenize(text, add_special_tokens=False)})
        return self._run(prompts, sampling_params, use_tqdm, None, lora_request)

    def _run(self, prompts: list[Any], sampling_params: Any, use_tqdm: bool | Callable[..., Any],
             priority: Sequence[int] | None, lora_request: Any = None) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling_params; they must match")
        else:
            raise InvalidArgumentError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                                       f"got {type(sampling_params).__name__}", "sampling_params")
        if priority is not None:
            if isinstance(priority, (str, bytes, Mapping)) or not hasattr(priority, "__len__"):
                raise InvalidArgumentError(f"priority must be a list of ints (one per prompt), got "
                                           f"{type(priority).__name__}", "priority")
            priority = list(priority)  # a numpy array too
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities; they must match")
        from sparrow.lora.engine import lora_requests_per_prompt

        lora_requests = lora_requests_per_prompt(lora_request, len(prompts))

        engine = self.llm_engine
        # Validate every prompt before any reaches the engine: a bad one costs no other its work.
        # id(params) -> (its checked copy, whether it is the model's defaults), as the engines resolve
        # a request's params (None: the defaults, whose max_tokens is cut to fit); once per object,
        # as a batch usually shares one.
        resolved: dict[int, tuple[SamplingParams, bool]] = {}
        processed = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = str(next(self._request_counter))
            if id(params) not in resolved:
                resolved[id(params)] = request_params(request_id, params, engine.default_sampling_params,
                                                      "sampling_params")
            checked, defaults = resolved[id(params)]
            if checked.output_kind != RequestOutputKind.FINAL_ONLY:
                # As vLLM's LLM: offline calls return whole outputs, whatever kind a SamplingParams
                # shared with streaming code asks for.
                checked = checked.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                resolved[id(params)] = (checked, defaults)
            request_priority = _check_priority(index, priority[index]) if priority is not None else 0
            processed.append(engine.process_request(request_id, prompt, checked, priority=request_priority,
                                                    lora_request=lora_requests[index], default_max_tokens=defaults))
        return self._submit_and_run(processed, use_tqdm)

    def _submit_and_run(self, processed: list[Any], use_tqdm: bool | Callable[..., Any]) -> list[Any]:
        engine = self.llm_engine
        order = {request.request_id: index for index, (_, request) in enumerate(processed)}
        # All or nothing: if one request cannot be sent, the ones sent before it are aborted, so
        # that no half of a batch stays registered to surface in a later call.
        try:
            for text, request in processed:
                engine.add_processed_request(text, request)
        except BaseException:
            self._abort_quietly(list(order))
            raise
        return self._run_engine(order, use_tqdm)

    def _abort_quietly(self, request_ids: list[str]) -> None:
        try:
            self.llm_engine.abort_request(request_ids)
        except Exception:  # noqa: BLE001 - already failing; the frontend has forgotten them
            pass

    def _run_engine(self, order: dict[str, int], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        engine = self.llm_engine
        results: list[RequestOutput | None] = [None] * len(order)
        bar = None
        # A pooling model generates nothing: its bar shows the prompts' speed only (as vLLM's).
        generates = engine.input_processor.pooling is None

        def speeds(elapsed: float) -> str:
            shown = f"est. speed input: {num_prompt_tokens / elapsed:.2f} toks/s"
            return shown + f", output: {num_output_tokens / elapsed:.2f} toks/s" if generates else shown

        num_prompt_tokens = num_output_tokens = 0
        if use_tqdm:
            from tqdm.auto import tqdm

            # As in vLLM, use_tqdm may be the progress bar class itself (a tqdm subclass or factory).
            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            bar = make_bar(total=len(order), desc="Processed prompts", dynamic_ncols=True, postfix=speeds(1.0))
        started = time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    # An output of an earlier, interrupted call is nobody's here.
                    if not output.finished or output.request_id not in order:
                        continue
                    results[order[output.request_id]] = output
                    if bar is not None:
                        if isinstance(output.outputs, list):  # a pooling output has a vector, no tokens
                            num_prompt_tokens += output.prompt_length
                            num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                        else:
                            num_prompt_tokens += len(output.prompt_token_ids or ())
                        bar.postfix = speeds(max(time.perf_counter() - started, 1e-9))
                        bar.update(1)
        except BaseException:
            # Interrupted (e.g. Ctrl-C) or a request failed in the engine core: leave the engine
            # clean for the next call.
            self._abort_quietly(list(order))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    def beam_search(self, prompts: Any, params: Any, lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[Any]:
        """vLLM's ``LLM.beam_search``: the ``params.beam_width`` most likely continuations of each
        prompt (a string, ``{"prompt": ...}`` or ``{"prompt_token_ids": [...]}``), as one
        ``BeamSearchOutput`` per prompt; ``concurrency_limit`` prompts are searched at a time (all
        when None). See sparrow.beam_search."""
        from sparrow.beam_search import beam_search

        return beam_search(self, prompts, params, lora_request, use_tqdm, concurrency_limit)

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters ``generate`` and ``chat`` use when given none: the model's generation
        config (``generation_config.json``, or the ``generation_config`` engine argument) over
        vLLM's neutral defaults."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's: free the device memory of the KV cache (discarded) and the weights (level 1:
        offloaded to host memory; level 2: discarded, to be loaded again after ``wake_up``) while
        no request runs, e.g. for an RLHF trainer on the same device. Needs ``enable_sleep_mode=True``."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: take back the memory of ``tags``: "weights", "kv_cache" (default: both)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def start_profile(self) -> None:
        """Start ``torch.profiler`` in every worker (vLLM's name); with ``SPARROW_TORCH_PROFILER_DIR``
        set, :meth:`stop_profile` writes each rank's Chrome trace there."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> list[dict[str, Any]]:
        """Stop the profilers; returns each rank's summary of the window: ``wall_s``,
        ``device_busy_s`` / ``device_busy_fraction`` (None without a GPU), ``device_s_by_family``
        and ``trace`` (the file written, or None)."""
        return self.llm_engine.stop_profile()

    # -- LoRA adapters (vLLM's names) ------------------------------------------------------
    def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter into the workers ahead of its first request."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def num_parameters(self) -> int:
        return self.llm_engine.collective_rpc("num_parameters")[0]

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: a worker method's name, or a function ``f(worker, *args, **kwargs)`` run on every
        worker (see ``LLMEngine.collective_rpc``); results in rank order."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def get_metrics(self) -> list[Any]:
        """vLLM's: the engine's metrics as objects (``sparrow.engine.metrics_reader``: Counter,
        Gauge, Vector, Histogram, each with its name and labels); needs ``disable_log_stats=False``."""
        return self.llm_engine.get_metrics()

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """vLLM's: ``func(model)`` on every worker's model (a ``torch.nn.Module``), for inspecting
        or changing weights in research code; results in rank order."""
        return self.llm_engine.apply_model(func)

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
