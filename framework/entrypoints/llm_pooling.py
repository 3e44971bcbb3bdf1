"""The pooling half of vLLM's offline ``LLM``: ``encode``, ``embed``, ``classify``, ``score`` and
``reward``, a mixin of :class:`sparrow.entrypoints.llm.LLM`.

A pooling engine (``runner="pooling"``) runs each prompt once and returns one vector: an
embedding model's pooled hidden state (``embed``), or a classifier's outputs over its labels
(``classify``). ``score`` compares two texts: the cosine similarity of an embedding model's two
vectors, or a cross-encoder's (a classifier with one label) output for both texts read together
(``sparrow.entrypoints.llm_score``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sparrow.engine.pooling_io import with_truncation
from sparrow.errors import InvalidArgumentError
from sparrow.outputs import ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput
from sparrow.pooling_params import POOLING_TASKS, PoolingParams


def prompt_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}")
    return list(prompts)


def _pooling_refused(method: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"LLM.{method}() needs a pooling model: start the LLM with runner='pooling' (an "
                                "embedding model such as Qwen3-Embedding, or a *ForSequenceClassification or "
                                "*ForTokenClassification checkpoint)", "runner")


class PoolingMethods:
    """``LLM``'s pooling methods; the class using it has ``llm_engine``, ``_request_counter`` and
    ``_submit_and_run``."""

    llm_engine: Any
    _request_counter: Any
    _submit_and_run: Callable[..., list[Any]]

    def _pooling_io(self, method: str) -> Any:
        pooling = self.llm_engine.input_processor.pooling
        if pooling is None:
            raise _pooling_refused(method)
        return pooling

    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool | Callable[..., Any] = True,
               lora_request: Any = None, pooling_task: str | None = None,
               tokenization_kwargs: dict[str, Any] | None = None) -> list[PoolingRequestOutput]:
        """One output per prompt from a pooling model (``runner="pooling"``), in input order:
        ``outputs.data`` is a float32 tensor, [width] for a prompt's vector, [prompt tokens, width]
        for a token-level task. ``pooling_params`` is one for all or one per prompt (None: the
        defaults); ``pooling_task`` one of the engine's tasks (None: its first, "embed" for an
        embedding model, "classify" for a sequence classifier, "token_classify" for a token
        classifier; "encode": the model's token-level task)."""
        if pooling_task is not None and pooling_task not in POOLING_TASKS:
            raise InvalidArgumentError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {pooling_task!r}",
                                       "pooling_task")
        if tokenization_kwargs:
            raise InvalidArgumentError("tokenization_kwargs are not supported: tokenize yourself and pass "
                                       "{'prompt_token_ids': [...]}, or use truncate_prompt_tokens",
                                       "tokenization_kwargs")
        prompts = prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params] * len(prompts)
        elif isinstance(pooling_params, (list, tuple)):
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} pooling_params; they must match")
        else:
            raise InvalidArgumentError(f"pooling_params must be a PoolingParams or a list of them (one per prompt), "
                                       f"got {type(pooling_params).__name__}", "pooling_params")
        from sparrow.lora.engine import lora_requests_per_prompt

        pooling = self._pooling_io("encode")
        lora_requests = lora_requests_per_prompt(lora_request, len(prompts))
        engine = self.llm_engine
        processed = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = str(next(self._request_counter))
            params = with_truncation(request_id, params, truncate_prompt_tokens)
            if pooling_task is not None:
                if params.task is not None and params.task != pooling_task:
                    raise InvalidArgumentError(f"pooling_params.task={params.task!r} and pooling_task="
                                               f"{pooling_task!r} disagree", "pooling_task")
                params = params.clone(task=pooling_task)
            resolved = pooling.resolve(request_id, params)
            processed.append(engine.process_request(request_id, prompt, pooling.carrier_params(resolved),
                                                    lora_request=lora_requests[index], pooling_params=resolved))
        return self._submit_and_run(processed, use_tqdm)

    def embed(self, prompts: Any, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable[..., Any] = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, lora_request: Any = None,
              tokenization_kwargs: dict[str, Any] | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: ``encode`` with each vector as ``outputs.embedding`` (a list of floats)."""
        self._pooling_io("embed")
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed",
                              tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(self, prompts: Any, *, use_tqdm: bool | Callable[..., Any] = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, lora_request: Any = None,
                 truncate_prompt_tokens: int | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` with a sequence classifier (``*ForSequenceClassification``):
        ``outputs.probs`` has one value per label, after the model's activation (softmax, or
        sigmoid for one label; ``PoolingParams(use_activation=False)``: the logits)."""
        self._pooling_io("classify")
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="classify",
                              tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def score(self, data_1: Any, data_2: Any, /, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable[..., Any] = True, pooling_params: PoolingParams | None = None,
              lora_request: Any = None, tokenization_kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's ``LLM.score``: one text against many, or two lists side by side. An embedding
        model scores the cosine similarity of each pair's vectors; a cross-encoder (a classifier
        with one label) reads each pair as one prompt (``sparrow.entrypoints.llm_score``)."""
        from sparrow.entrypoints.llm_score import cross_encoder_score, embedding_score

        pooling = self._pooling_io("score")
        scorer = cross_encoder_score if pooling.head == "classify" else embedding_score
        return scorer(self, data_1, data_2, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                      pooling_params=pooling_params, lora_request=lora_request,
                      tokenization_kwargs=tokenization_kwargs)

    def reward(self, prompts: Any, /, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool | Callable[..., Any] = True,
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, lora_request: Any = None,
               tokenization_kwargs: dict[str, Any] | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.reward``: a classifier's outputs at every prompt token (``token_classify``;
        ``outputs.data`` [prompt tokens, labels]), as a token classifier or a reward model gives them."""
        self._pooling_io("reward")
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="token_classify",
                           tokenization_kwargs=tokenization_kwargs)
