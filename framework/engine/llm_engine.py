"""LLMEngine: the synchronous frontend (input processor -> engine core client -> output processor)."""

from __future__ import annotations

import logging
from typing import Any

from sparrow.config import EngineConfig
from sparrow.engine.input_processor import PromptType
from sparrow.engine.messages import SchedulerStats
from sparrow.engine.setup import build_frontend, finalize_config
from sparrow.outputs import RequestOutput
from sparrow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def make_engine_client(config: EngineConfig, multiprocess: bool | None = None) -> Any:
    """The engine-core client: data-parallel router, multiprocess (default) or in-process
    (``SPARROW_ENABLE_MULTIPROCESSING=0``), decided in one place (``mp_client.make_client``)."""
    if config.parallel.data_parallel_size > 1:
        from sparrow.engine.dp_client import DPClient

        return DPClient(config, multiprocess=multiprocess)
    from sparrow.engine.mp_client import make_client

    return make_client(config, multiprocess)


class LLMEngine:
    def __init__(self, config: EngineConfig, multiprocess: bool | None = None) -> None:
        self.config = finalize_config(config)
        frontend = build_frontend(self.config)
        self.tokenizer, self.hf_config = frontend.tokenizer, frontend.hf_config
        self.input_processor = frontend.input_processor
        self.output_processor = frontend.output_processor
        self.engine_core = make_engine_client(self.config, multiprocess)
        kv_info = self.engine_core.call_utility("get_kv_cache_info")
        self.kv_cache_capacity_tokens = kv_info["num_blocks"] * kv_info["block_size"]
        self.last_stats: SchedulerStats | None = None

    # -- requests ---------------------------------------------------------------------------
    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0):
        """Validate and tokenize; raises ValueError naming the prompt. Touches no engine state."""
        text, request = self.input_processor.process_inputs(request_id, prompt, params, priority=priority)
        needed = min(len(request.prompt_token_ids) + (request.max_tokens or 0), self.config.model.max_model_len)
        if needed > self.kv_cache_capacity_tokens:
            raise ValueError(
                f"request {request_id!r} needs KV cache for {needed} tokens but the whole cache holds "
                f"{self.kv_cache_capacity_tokens}; lower max_tokens or raise kv_cache_memory_bytes / num_kv_blocks"
            )
        return text, request

    def add_processed_request(self, text: str | None, request: Any) -> None:
        for child in self.output_processor.add_request(request, text):
            self.engine_core.add_request(child)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> None:
        text, request = self.process_request(request_id, prompt, params, priority)
        self.add_processed_request(text, request)

    def abort_request(self, request_ids: list[str] | str) -> None:
        engine_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(engine_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
        errors = [(o.request_id, o.error_message) for o in outputs.outputs if o.error_message]
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if errors:
            # The engine core refused a request (it can never run); the others carry on.
            raise ValueError("; ".join(f"request {rid!r}: {message}" for rid, message in errors))
        return processed.request_outputs

    # -- utilities --------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.engine_core.call_utility("reset_prefix_cache")

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self.engine_core.call_utility("collective_rpc", method, args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
