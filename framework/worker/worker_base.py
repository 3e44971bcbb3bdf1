"""The worker every platform builds on: device, model, KV cache, one step at a time."""

from __future__ import annotations

import logging
from typing import Any

import torch

from sparrow.config import EngineConfig
from sparrow.core.sched.output import SchedulerOutput
from sparrow.platforms.interface import Platform
from sparrow.plugins import check_attention_backend, get_plugin_manager
from sparrow.worker.model_runner import DTYPES, ModelRunner
from sparrow.worker.outputs import ModelRunnerOutput
from sparrow.worker.profiler import WorkerProfiler
from sparrow.worker.sleep_mode import WorkerSleep

logger = logging.getLogger(__name__)


class WorkerBase:
    """Subclasses set ``model_runner_cls`` and implement :meth:`available_kv_cache_bytes`."""

    model_runner_cls: type[ModelRunner] = ModelRunner

    def __init__(self, config: EngineConfig, platform: Platform, rank: int = 0, local_rank: int = 0,
                 world_size: int = 1, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.platform = platform
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        self.dtype = DTYPES[platform.resolve_dtype(config.model.dtype)]
        self.block_size = config.cache.block_size or platform.default_block_size
        # Data-parallel engines on one machine take consecutive groups of tensor-parallel devices.
        parallel = config.parallel
        self.device: torch.device = platform.device_for_rank(
            parallel.data_parallel_rank * parallel.tensor_parallel_size + local_rank)
        self.tp: Any = None
        self.model_runner: ModelRunner | None = None
        self.profiler = WorkerProfiler(self.device, self.rank)  # LLM.start_profile / stop_profile
        self.sleep_state = WorkerSleep()  # LLM.sleep / wake_up

    # -- start-up ---------------------------------------------------------------------------
    def init_device(self) -> None:
        torch.manual_seed(self.config.model.seed)
        if self.world_size > 1:
            from sparrow.worker.distributed import init_distributed

            self.tp = init_distributed(self.platform, self.rank, self.world_size, self.distributed_init_method,
                                       self.device)
            if self.config.parallel.enable_expert_parallel:
                import dataclasses

                self.tp = dataclasses.replace(self.tp, expert_parallel=True)

    def attention_backend_cls(self, hf_config: Any) -> type:
        pm = get_plugin_manager()
        backend = check_attention_backend(pm, pm.hook.sparrow_attention_backend(
            platform=self.platform, requested=self.config.device.attention_backend, model_config=hf_config))
        if backend is None:
            raise ValueError(
                f"no attention backend {self.config.device.attention_backend!r} for platform {self.platform.name!r}"
            )
        return backend

    def load_model(self) -> None:
        from sparrow.model_loader import load_model, model_hf_config

        model_dir = self.config.model.model
        assert model_dir is not None, "the engine's setup fills the model directory"
        hf_config = model_hf_config(self.config.model)
        model = load_model(model_dir, self.attention_backend_cls(hf_config), self.dtype, self.device, tp=self.tp,
                           config=self.config)
        self.bind_ops(model, hf_config)
        self.model_runner = self.model_runner_cls(self.config, model, self.device, self.dtype, self.block_size,
                                                  tp_rank=self.rank, platform=self.platform.name)

    def bind_ops(self, model: Any, hf_config: Any) -> None:
        """Give every registered-op layer its implementation on this platform (a quantization
        method's first), packing weights where an implementation asks; logs the choice on rank 0."""
        from sparrow.ops import bind_ops
        from sparrow.quantization import op_overrides_for

        overrides = op_overrides_for(self.config, self.platform.name, hf_config)
        summary = bind_ops(model, self.platform.name, overrides=overrides)
        if self.rank == 0:
            logger.info("ops on %s: %s", self.platform.name, "; ".join(
                f"{op} {', '.join(f'{impl} x{count}' for impl, count in impls.items())}"
                for op, impls in summary.items()))

    def available_kv_cache_bytes(self) -> int:
        raise NotImplementedError

    def determine_num_kv_blocks(self) -> int:
        assert self.model_runner is not None
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        per_block = self.model_runner.kv_cache_bytes_per_block()
        available = self.available_kv_cache_bytes()
        # Optional (sparrow.worker.model_runner.ModelRunner has it): a runner written before it keeps working.
        fixed = getattr(self.model_runner, "kv_cache_fixed_bytes", lambda: 0)()
        num_blocks = (available - fixed) // per_block
        if num_blocks < 1:
            besides = f" besides {fixed} bytes of draft-model blocks" if fixed else ""
            raise ValueError(
                f"the KV cache budget ({available} bytes) holds no block of {per_block} bytes{besides}; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization"
            )
        return int(num_blocks)

    def kv_cache_groups(self) -> list[tuple[int | None, list[int]]]:
        """``(sliding_window, layer_indices)`` of each KV cache group, for the engine core's KV
        cache manager: one group of every layer unless the model mixes sliding-window and
        full-attention layers."""
        assert self.model_runner is not None
        return [(group.sliding_window, list(group.layer_indices)) for group in self.model_runner.kv_cache_groups]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks)
        from sparrow.kv_transfer import KVConnectorRole, build_connector

        connector = build_connector(self.config, KVConnectorRole.WORKER, self.block_size)
        if connector is not None:
            connector.rank = self.rank
            connector.register_kv_caches(self.model_runner.kv_caches)
            self.model_runner.kv_connector = connector

    # -- steps ------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model_runner is not None
        return self.model_runner.execute_model(scheduler_output)

    def execute_model_deferred(self, scheduler_output: SchedulerOutput) -> Any:
        """The step without waiting for its sampled tokens: a ``ModelRunnerOutput``, or an object
        whose ``result()`` gives it (overlapped scheduling in one process)."""
        assert self.model_runner is not None
        deferred = getattr(self.model_runner, "execute_model_deferred", None)  # a plugin's runner may lack it
        return (deferred or self.model_runner.execute_model)(scheduler_output)

    def feed_counts(self) -> dict[str, int]:
        """Overlapped scheduling: how the steps after deferred ones got their tokens (see
        ``ModelRunner.feed_counts``)."""
        return dict(getattr(self.model_runner, "feed_counts", {}))

    def num_parameters(self) -> int:
        """The whole model's parameter count, however it is split across tensor-parallel ranks."""
        assert self.model_runner is not None
        if self.world_size == 1:
            return sum(p.numel() for p in self.model_runner.model.parameters())
        from sparrow.model_loader import checkpoint_num_parameters

        assert self.config.model.model is not None
        return checkpoint_num_parameters(self.config.model.model, self.config.model.trust_remote_code)

    # -- LoRA adapters (the engine core's add_lora / remove_lora / list_loras) -------------------
    def _lora_manager(self) -> Any:
        manager = self.model_runner.lora_manager if self.model_runner is not None else None
        if manager is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        return manager

    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        from sparrow.lora.request import LoRARequest

        self._lora_manager().add_adapter(LoRARequest(lora_name, lora_int_id, lora_path))
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora_manager().remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._lora_manager().list_adapters()

    def lora_stats(self) -> dict[str, int]:
        """Cumulative adapter loads from disk, into device slots, and slot swaps."""
        import dataclasses

        return dataclasses.asdict(self._lora_manager().stats)

    # -- sleep mode and weights (LLM.sleep / wake_up, collective_rpc("reload_weights")) ----------
    def sleep(self, level: int = 1) -> dict[str, int]:
        """Release the KV cache and the weights' device memory (sparrow.worker.sleep_mode);
        returns the bytes released per tag."""
        assert self.model_runner is not None
        released = self.sleep_state.sleep(self.model_runner, level)
        logger.info("rank %d asleep (level %d): released %s", self.rank, level,
                    ", ".join(f"{tag} {size / 2**20:.1f} MiB" for tag, size in released.items()))
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleep_state.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_state.sleeping

    def reload_weights(self) -> None:
        """vLLM's: load the checkpoint into the model again, with the configured loader (after
        ``sleep(level=2)``, or to undo a weight update); repacked weights are repacked."""
        from pathlib import Path

        from sparrow.model_loader import get_model_loader

        assert self.model_runner is not None and self.config.model.model is not None
        with torch.no_grad():
            get_model_loader(self.config).load_weights(self.model_runner.model, Path(self.config.model.model),
                                                       self.tp)

    # -- profiling (the engine core's profile, LLM.start_profile / stop_profile) -----------------
    def start_profile(self) -> None:
        self.profiler.start()

    def stop_profile(self) -> dict[str, Any]:
        return self.profiler.stop()

    def ping(self) -> str:
        return "pong"

    def shutdown(self) -> None:
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
