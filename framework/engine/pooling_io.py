"""The frontend's half of a pooling model (runner="pooling"): a request's ``PoolingParams``
checked against the model, its engine-core request, and the vector that comes back turned into
a ``PoolingRequestOutput`` (an embedding cut to ``dimensions``, then L2-normalized when asked;
a classifier's logits through its activation, softmax or sigmoid, unless ``use_activation`` is
False; a token-level task's rows, one per prompt token, each treated so).

The engine core returns the worker's pooled output as it is (sparrow.worker.pooler); applying
the per-request choices here keeps the step loop free of them, and costs one vector per prompt.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from sparrow.errors import InvalidArgumentError
from sparrow.outputs import PoolingOutput, PoolingRequestOutput
from sparrow.pooling import architecture_is_token_classifier, classifier_activation, matryoshka_dimensions, num_labels
from sparrow.pooling_params import TOKEN_TASKS, PoolingParams
from sparrow.sampling_params import RequestOutputKind, SamplingParams

# What a pooling request's EngineCoreRequest carries as sampling parameters: nothing is sampled
# (the request finishes when its prompt is computed), and nothing is detokenized.
_CARRIER = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


class PoolingIO:
    def __init__(self, pooler_config: dict[str, Any], hf_config: Any, head: str = "embed") -> None:
        self.head = head  # "embed" or "classify" (the finalized convert)
        self.default_normalize = bool(pooler_config.get("normalize", True))
        self.default_activation = bool(pooler_config.get("use_activation", True))
        self.hidden_size = int(hf_config.hidden_size)
        self.matryoshka = matryoshka_dimensions(hf_config)
        self.num_labels = num_labels(hf_config) if head == "classify" else None
        # vLLM's tasks, the default first: a cross-encoder scores (a pair's one logit) when it has
        # a single label; a token classifier's score layer is only read at every token.
        if head == "embed":
            self.supported_tasks: tuple[str, ...] = ("embed", "token_embed")
        elif architecture_is_token_classifier(hf_config):
            self.supported_tasks = ("token_classify",)
        else:
            self.supported_tasks = ("classify", "score", "token_classify") if self.num_labels == 1 else \
                ("classify", "token_classify")
        # task -> the activation over a classifier's logits, or why it cannot be applied
        self._activations: dict[str, str] = {}
        self._unusable: dict[str, str] = {}
        for task in self.supported_tasks if head == "classify" else ():
            try:
                self._activations[task] = classifier_activation(hf_config, task)
            except ValueError as exc:
                self._unusable[task] = str(exc)

    def activation(self, params: PoolingParams) -> str | None:
        """The activation over a resolved request's logits (None: an embedding, or raw logits)."""
        if self.head != "classify" or params.use_activation is False:
            return None
        return self._activations.get(params.task or "classify")

    def resolve(self, request_id: str, params: Any, field: str = "pooling_params") -> PoolingParams:
        """``params`` (None: the defaults) checked against this model, with ``task`` and
        ``normalize`` / ``use_activation`` filled in."""
        if params is None:
            params = PoolingParams()
        elif not isinstance(params, PoolingParams):
            raise InvalidArgumentError(f"{field} of request {request_id!r} must be PoolingParams, got "
                                       f"{type(params).__name__}", field)
        task = params.task or self.supported_tasks[0]
        if task == "encode":  # vLLM's older name for the model's token-level task
            task = "token_embed" if self.head == "embed" else "token_classify"
        if task not in self.supported_tasks:
            kind = "an embedding model" if self.head == "embed" else \
                f"a {'token ' if self.supported_tasks == ('token_classify',) else ''}classifier with " \
                f"{self.num_labels} labels"
            extra = " (score needs a cross-encoder: a classifier with one label)" if task == "score" else ""
            raise InvalidArgumentError(f"task={task!r}: this engine runs {kind}, whose tasks are "
                                       f"{', '.join(self.supported_tasks)}{extra}", "task")
        if task in self._unusable:
            raise InvalidArgumentError(f"task={task!r}: {self._unusable[task]}", "task")
        if self.head == "classify":
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise InvalidArgumentError(f"{name}={getattr(params, name)!r} applies to embeddings; task "
                                               f"{task!r} returns a classifier's outputs (see use_activation)", name)
            use_activation = self.default_activation if params.use_activation is None else params.use_activation
            return params.clone(task=task, use_activation=use_activation)
        if params.use_activation is not None:
            raise InvalidArgumentError(f"use_activation={params.use_activation!r} applies to a classifier's outputs; "
                                       "this engine runs an embedding model (see normalize)", "use_activation")
        self._check_dimensions(params.dimensions)
        return params.clone(task=task, normalize=self.default_normalize if params.normalize is None
                            else params.normalize)

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if self.matryoshka is None:
            raise InvalidArgumentError(
                f"dimensions={dimensions}: this model does not declare Matryoshka embeddings (is_matryoshka or "
                "matryoshka_dimensions in config.json, or through hf_overrides), so its vectors cannot be "
                "shortened", "dimensions")
        if self.matryoshka and dimensions not in self.matryoshka:
            raise InvalidArgumentError(f"dimensions={dimensions} is not one of the model's Matryoshka dimensions "
                                       f"{self.matryoshka}", "dimensions")
        if dimensions > self.hidden_size:
            raise InvalidArgumentError(f"dimensions={dimensions} exceeds the model's {self.hidden_size}", "dimensions")

    @staticmethod
    def carrier_params(params: PoolingParams) -> SamplingParams:
        """The sampling parameters that carry a pooling prompt through the input processor."""
        if params.truncate_prompt_tokens is None:
            return _CARRIER
        return _CARRIER.clone(truncate_prompt_tokens=params.truncate_prompt_tokens)


def pooled_output(request_id: str, vector: bytes | None, params: PoolingParams, prompt: str | None,
                  prompt_token_ids: list[int], num_cached_tokens: int,
                  activation: str | None = None) -> PoolingRequestOutput:
    """The caller's output for the engine core's vector (None: the request was aborted, and
    ``outputs.data`` is None). ``activation`` ("softmax", "sigmoid", "identity" or None) is
    applied to a classifier's logits (PoolingIO.activation). A token-level task's data has one
    row per prompt token."""
    data = None
    if vector is not None:
        import torch

        values = np.frombuffer(vector, dtype="<f4")
        if params.task in TOKEN_TASKS:  # one row per prompt token
            values = values.reshape(len(prompt_token_ids), -1)
        if activation is not None:  # a classifier's logits
            data = torch.from_numpy(values.copy())
            if activation == "softmax":
                data = torch.softmax(data, dim=-1)
            elif activation == "sigmoid":
                data = torch.sigmoid(data)
        else:  # an embedding (each row's, for token_embed)
            if params.dimensions is not None:
                values = values[..., : params.dimensions]
            if params.normalize:
                # As torch.nn.functional.normalize: x / max(||x||, eps).
                norms = np.linalg.norm(values.astype(np.float64), axis=-1, keepdims=True)
                values = values / np.maximum(norms, 1e-12)
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
    return PoolingParams(**{**msgspec.structs.asdict(params), "truncate_prompt_tokens": truncate_prompt_tokens})
