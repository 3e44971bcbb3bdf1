"""vLLM's ``vllm.v1.sample.logits_processor``: the batch-level logits processor interface."""

from sparrow.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    process_dict_updates,
)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest",
           "process_dict_updates"]
