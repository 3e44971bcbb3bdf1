"""Clients the frontend uses to talk to the engine core.

``InprocClient`` runs the engine core inside the caller's process (tests, debugging: set
``SPARROW_ENABLE_MULTIPROCESSING=0``). The multiprocess clients live in ``mp_client``.
"""

from __future__ import annotations

from typing import Any

from sparrow.config import EngineConfig
from sparrow.engine.core import EngineCore
from sparrow.engine.messages import EngineCoreOutputs, EngineCoreRequest
from sparrow.executor import Executor


class InprocClient:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.engine_core = EngineCore(config, executor)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
