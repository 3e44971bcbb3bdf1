"""``LoRARequest``: which adapter a request runs with (vLLM's class, field for field).

A leaf module (msgspec only, no torch): the request travels inside ``EngineCoreRequest`` to the
engine core and, inside ``NewRequestData``, to the workers, which load the adapter from
``lora_path`` (a local PEFT directory) the first time they see its ``lora_int_id``.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A LoRA adapter for one request.

    ``lora_name``: a name unique among the adapters being served (the server's model name for it);
    ``lora_int_id``: a unique integer >= 1 (0 stands for the base model in vLLM); ``lora_path``: a
    local directory with PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``;
    ``base_model_name``: the served base model it belongs to (the server's /v1/models ``parent``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        # Runs on construction and when msgspec decodes one from the wire: an invalid adapter
        # request is refused wherever it enters.
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_request.lora_path must be a string, got {type(self.lora_path).__name__}")

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
