"""vLLM's ``vllm.v1.engine``: the messages between the frontend and the engine core."""

from sparrow.wire import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "FinishReason"]
