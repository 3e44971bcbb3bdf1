"""What a platform plugin provides: identity, defaults and its worker class."""

from __future__ import annotations

from typing import Any


class Platform:
    """Subclass per device type. Instances are cheap; heavy imports happen in the worker."""

    name: str = "abstract"
    device_type: str = "cpu"  # torch device type
    dist_backend: str = "gloo"  # torch.distributed backend for tensor parallel
    default_block_size: int = 16
    # Token budget per step when the user sets none (max_num_batched_tokens).
    default_max_num_batched_tokens: int = 8192
    default_dtype: str = "float32"
    supported_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    # "package.module:WorkerClass"
    worker_cls: str = ""

    def resolve_dtype(self, requested: str) -> str:
        dtype = self.default_dtype if requested == "auto" else requested
        if dtype not in self.supported_dtypes:
            raise ValueError(
                f"dtype {requested!r} is not supported on platform {self.name!r}; "
                f"supported: {', '.join(self.supported_dtypes)}"
            )
        return dtype

    def device_for_rank(self, local_rank: int) -> Any:
        import torch

        return torch.device(self.device_type)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
