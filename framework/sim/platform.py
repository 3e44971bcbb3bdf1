"""The simulated platform (``device="sim"``): the real engine core, scheduler and KV cache manager
over a worker that runs no model (``sparrow.sim.worker``). No heavy imports here.

Settings travel in ``additional_config`` (flat keys, all optional)::

    sim_gpu              the card simulated: h100 (default), h200, a100, l40s (sparrow.sim.gpus)
    sim_tokens           "random" (default): seeded ids; "copy": output k is prompt[k % len]
    sim_step_overhead_s  host seconds per step (default: the calibrated value, sparrow.sim.cost)
    sim_token_overhead_s host seconds per sampled token (default: the calibrated value)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparrow.config import ConfigError
from sparrow.platforms.interface import Platform
from sparrow.sim.cost import STEP_OVERHEAD_S, TOKEN_OVERHEAD_S
from sparrow.sim.gpus import GPUS, GpuSpec

if TYPE_CHECKING:
    from sparrow.config import EngineConfig

TOKEN_MODES = ("random", "copy")
SETTINGS = ("sim_gpu", "sim_tokens", "sim_step_overhead_s", "sim_token_overhead_s")


@dataclass(frozen=True, slots=True)
class SimSettings:
    gpu: GpuSpec
    tokens: str = "random"
    step_overhead_s: float = STEP_OVERHEAD_S
    token_overhead_s: float = TOKEN_OVERHEAD_S


def sim_settings(additional_config: dict[str, Any]) -> SimSettings:
    """The simulated device's settings from ``additional_config``; ConfigError naming the key."""
    unknown = sorted(key for key in additional_config if key.startswith("sim_") and key not in SETTINGS)
    if unknown:
        raise ConfigError(f"invalid engine argument 'additional_config': unknown key(s) {', '.join(unknown)} "
                          f"for device 'sim'; known: {', '.join(SETTINGS)}")
    name = additional_config.get("sim_gpu", "h100")
    if not isinstance(name, str) or name.lower() not in GPUS:
        raise ConfigError(f"invalid engine argument 'sim_gpu': unknown simulated GPU {name!r}; "
                          f"known: {', '.join(GPUS)}")
    tokens = additional_config.get("sim_tokens", "random")
    if tokens not in TOKEN_MODES:
        raise ConfigError(f"invalid engine argument 'sim_tokens': must be one of {', '.join(TOKEN_MODES)}, "
                          f"got {tokens!r}")
    overheads = {}
    for key, default in (("sim_step_overhead_s", STEP_OVERHEAD_S), ("sim_token_overhead_s", TOKEN_OVERHEAD_S)):
        value = additional_config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"invalid engine argument '{key}': must be a number of seconds >= 0, got {value!r}")
        overheads[key] = float(value)
    return SimSettings(GPUS[name.lower()], tokens, overheads["sim_step_overhead_s"], overheads["sim_token_overhead_s"])


class SimPlatform(Platform):
    name = "sim"
    device_type = "cpu"  # nothing is placed on it: the worker holds no tensors
    default_block_size = 16
    default_max_num_batched_tokens = 8192  # the CUDA platform's default
    default_dtype = "bfloat16"
    supported_dtypes = ("bfloat16", "float16", "float32")
    worker_cls = "sparrow.sim.worker:SimWorker"
    supports_pooling = False  # no hidden states to pool: the forward is a cost model

    def check_and_update_config(self, config: EngineConfig) -> None:
        sim_settings(config.additional_config)
        if config.parallel.tensor_parallel_size != 1:
            raise ConfigError("invalid engine argument 'tensor_parallel_size': device 'sim' simulates one card, "
                              f"got {config.parallel.tensor_parallel_size}")
        if config.load.load_format == "auto":
            # No weights are read: a directory with only config.json passes the pre-flight checks.
            config.load.load_format = "dummy"

