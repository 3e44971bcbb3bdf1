"""The served models (``/v1/models``, ``/v1/models/{id}``) and the LoRA adapters: ``--lora-modules``,
the adapter name as a request's ``model``, the adapters in ``/v1/models``, and vLLM's runtime
endpoints::

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}
    POST /v1/unload_lora_adapter  {"lora_name": ...}

The two endpoints exist only when ``SPARROW_ALLOW_RUNTIME_LORA_UPDATING`` is true (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): loading a directory named by a client is opt-in.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from pydantic import BaseModel, ConfigDict

from sparrow.entrypoints.openai.serving_engine import APIError
from sparrow.lora.request import LoRARequest

logger = logging.getLogger(__name__)

ENV_RUNTIME_LORA = "SPARROW_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def runtime_lora_updating() -> bool:
    return os.environ.get(ENV_RUNTIME_LORA, "").strip().lower() in ("1", "true", "yes", "on")


def parse_lora_module(value: str) -> dict[str, Any]:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = value.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: not valid JSON ({exc}): {value!r}") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(
                entry.get("path"), str) or set(entry) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(f'--lora-modules: expected {{"name": str, "path": str, '
                                             f'"base_model_name": str}}, got {value!r}')
        return entry
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path or a JSON object, got {value!r}")
    return {"name": name, "path": path}


class LoRAModules:
    """Adapter name -> LoRARequest, shared by every endpoint of one app."""

    def __init__(self, engine: Any, base_model_name: str) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1

    def new_request(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> LoRARequest:
        """A LoRARequest with the next unused id (ids are never reused: the prefix cache and the
        workers key adapters by id)."""
        request = LoRARequest(lora_name, self._next_id, lora_path, base_model_name or self.base_model_name)
        self._next_id += 1
        return request

    def get(self, model: str | None) -> LoRARequest | None:
        return self.adapters.get(model) if model is not None else None

    async def load(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register and load an adapter; APIError 400 naming the field at fault."""
        if not lora_name or not lora_path:
            field = "lora_name" if not lora_name else "lora_path"
            raise APIError(400, f"{field} must be a non-empty string", "BadRequestError", param=field,
                           code="invalid_value")
        if lora_name in self.adapters or lora_name == self.base_model_name:
            raise APIError(400, f"The lora adapter {lora_name!r} has already been loaded.", "BadRequestError",
                           param="lora_name", code="invalid_value")
        request = self.new_request(lora_name, lora_path, base_model_name)
        try:
            await self.engine.add_lora(request)
        except ValueError as exc:  # the adapter's directory, config or tensors
            raise APIError(400, str(exc), "BadRequestError", param="lora_path", code="invalid_value") from None
        self.adapters[lora_name] = request
        return request

    async def unload(self, lora_name: str) -> None:
        request = self.adapters.get(lora_name)
        if request is None:
            raise APIError(404, f"The lora adapter {lora_name!r} cannot be found.", "NotFoundError",
                           param="lora_name", code="model_not_found")
        del self.adapters[lora_name]
        await self.engine.remove_lora(request.lora_int_id)


def lora_modules_from_args(engine: Any, args: argparse.Namespace | None) -> LoRAModules | None:
    """The adapters of ``--lora-modules`` (checked now, loaded by the workers on first use), or
    None when the engine serves no LoRA."""
    entries = getattr(args, "lora_modules", None) or []
    if not engine.config.lora.enable_lora:
        if entries:
            raise SystemExit("sparrow serve: --lora-modules needs --enable-lora")
        return None
    from sparrow.lora.engine import check_lora_request

    modules = LoRAModules(engine, engine.served_model_name)
    for entry in entries:
        name = entry["name"]
        if name in modules.adapters or name == engine.served_model_name:
            raise SystemExit(f"sparrow serve: --lora-modules: the name {name!r} is used twice")
        request = modules.new_request(name, entry["path"], entry.get("base_model_name"))
        try:
            check_lora_request(request, engine.config, engine.hf_config)
        except ValueError as exc:
            raise SystemExit(f"sparrow serve: --lora-modules {name}: {exc}") from None
        modules.adapters[name] = request
    return modules


def add_lora_routes(app: Any, modules: LoRAModules) -> None:
    """The runtime load/unload endpoints (only called when runtime updating is allowed)."""
    from fastapi.responses import PlainTextResponse

    logger.warning("%s is set: clients may load LoRA adapters from this machine's files", ENV_RUNTIME_LORA)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await modules.load(request.lora_name, request.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await modules.unload(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


def add_model_routes(app: Any, engine: Any, model_names: list[str], lora_modules: Any,
                     error_responses: dict[Any, Any]) -> None:
    """``GET /v1/models`` (the base model's names, then the adapters, loaded at runtime too) and
    ``GET /v1/models/{id}`` (404 model_not_found for a name not served)."""
    from sparrow.entrypoints.openai.protocol import ModelCard, ModelList

    adapters = lora_modules.adapters if lora_modules is not None else {}  # the live dict: runtime loads show

    def model_card(name: str) -> ModelCard:
        adapter = adapters.get(name)
        if adapter is not None:  # vLLM's adapter card: root is the adapter's path, parent the base model
            return ModelCard(id=name, root=adapter.lora_path, parent=adapter.base_model_name,
                             max_model_len=engine.model_config.max_model_len)
        return ModelCard(id=name, root=engine.model_config.model, max_model_len=engine.model_config.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(name) for name in [*model_names, *adapters]])

    # ":path": a served name may hold slashes (a model directory, "Qwen/Qwen3-0.6B").
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses)
    async def retrieve_model(model_id: str) -> ModelCard:
        if model_id not in model_names and model_id not in adapters:
            served = ", ".join([*model_names, *adapters])
            raise APIError(404, f"the model {model_id!r} does not exist; served: {served}",
                           "NotFoundError", param="model", code="model_not_found")
        return model_card(model_id)
