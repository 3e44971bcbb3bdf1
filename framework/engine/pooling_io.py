"""The frontend's half of a pooling model (runner="pooling"): a request's ``PoolingParams``
checked against the model, its engine-core request, and the vector that comes back turned into
a ``PoolingRequestOutput`` (cut to ``dimensions``, then L2-normalized when asked).

The engine core returns the worker's pooled vector as it is (sparrow.worker.pooler); applying
the per-request choices here keeps the step loop free of them, and costs one vector per prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparrow.errors import InvalidArgumentError
from sparrow.outputs import PoolingOutput, PoolingRequestOutput
from sparrow.pooling import matryoshka_dimensions
from sparrow.pooling_params import PoolingParams
from sparrow.sampling_params import RequestOutputKind, SamplingParams

# What a pooling request's EngineCoreRequest carries as sampling parameters: nothing is sampled
# (the request finishes when its prompt is computed), and nothing is detokenized.
_CARRIER = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


class PoolingIO:
    def __init__(self, pooler_config: dict[str, Any], hf_config: Any) -> None:
        self.default_normalize = bool(pooler_config.get("normalize", True))
        self.hidden_size = int(hf_config.hidden_size)
        self.matryoshka = matryoshka_dimensions(hf_config)

    def resolve(self, request_id: str, params: Any, field: str = "pooling_params") -> PoolingParams:
        """``params`` (None: the defaults) checked against this model, with ``normalize`` filled in."""
        if params is None:
            params = PoolingParams()
        elif not isinstance(params, PoolingParams):
            raise InvalidArgumentError(f"{field} of request {request_id!r} must be PoolingParams, got "
                                       f"{type(params).__name__}", field)
        dimensions = params.dimensions
        if dimensions is not None:
            if self.matryoshka is None:
                raise InvalidArgumentError(
                    f"dimensions={dimensions}: this model does not declare Matryoshka embeddings (is_matryoshka or "
                    "matryoshka_dimensions in config.json, or through hf_overrides), so its vectors cannot be "
                    "shortened", "dimensions")
            if self.matryoshka and dimensions not in self.matryoshka:
                raise InvalidArgumentError(f"dimensions={dimensions} is not one of the model's Matryoshka dimensions "
                                           f"{self.matryoshka}", "dimensions")
            if dimensions > self.hidden_size:
                raise InvalidArgumentError(f"dimensions={dimensions} exceeds the model's {self.hidden_size}",
                                           "dimensions")
        if params.normalize is None:
            params = params.clone(normalize=self.default_normalize)
        return params

    @staticmethod
    def carrier_params(params: PoolingParams) -> SamplingParams:
        """The sampling parameters that carry a pooling prompt through the input processor."""
        if params.truncate_prompt_tokens is None:
            return _CARRIER
        return _CARRIER.clone(truncate_prompt_tokens=params.truncate_prompt_tokens)


def pooled_output(request_id: str, vector: bytes | None, params: PoolingParams, prompt: str | None,
                  prompt_token_ids: list[int], num_cached_tokens: int) -> PoolingRequestOutput:
    """The caller's output for the engine core's vector (None: the request was aborted, and
    ``outputs.data`` is None)."""
    data = None
    if vector is not None:
        import torch

        values = np.frombuffer(vector, dtype="<f4")
        if params.dimensions is not None:
            values = values[: params.dimensions]
        if params.normalize:
            # As torch.nn.functional.normalize: x / max(||x||, eps).
            values = values / max(float(np.linalg.norm(values.astype(np.float64))), 1e-12)
        data = torch.from_numpy(np.array(values, dtype=np.float32))
    return PoolingRequestOutput(request_id=request_id, outputs=PoolingOutput(data), prompt_token_ids=prompt_token_ids,
                                finished=True, num_cached_tokens=num_cached_tokens, prompt=prompt)


def request_kind(processor: Any, request_id: str, params: Any, default_sampling_params: dict[str, Any],
                 field: str) -> tuple[SamplingParams, bool, PoolingParams | None]:
    """What an ``add_request(params=...)`` asks for, as vLLM takes either kind there: (the sampling
    parameters for the input processor, whether they are the model's defaults, the resolved
    pooling parameters or None). ``params`` None is the engine's kind of request with defaults."""
    from sparrow.engine.async_inputs import request_params

    pooling = processor.pooling
    if isinstance(params, PoolingParams) or (params is None and pooling is not None):
        if pooling is None:
            raise InvalidArgumentError(f"{field} of request {request_id!r} are PoolingParams, and this engine runs "
                                       "a generative model; pooling needs an engine started with runner='pooling'",
                                       field)
        resolved = pooling.resolve(request_id, params, field)
        return pooling.carrier_params(resolved), False, resolved
    sampling, defaults = request_params(request_id, params, default_sampling_params, field)
    return sampling, defaults, None


def with_truncation(request_id: str, params: Any, truncate_prompt_tokens: int | None,
                    field: str = "pooling_params") -> PoolingParams:
    """``params`` (None: the defaults) with vLLM's separate ``truncate_prompt_tokens`` argument
    folded in (checked again, as a new PoolingParams)."""
    if params is None:
        params = PoolingParams()
    elif not isinstance(params, PoolingParams):
        raise InvalidArgumentError(f"{field} of request {request_id!r} must be PoolingParams, got "
                                   f"{type(params).__name__}", field)
    if truncate_prompt_tokens is None:
        return params
    return PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens, dimensions=params.dimensions,
                         normalize=params.normalize, task=params.task)
