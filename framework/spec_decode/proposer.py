"""The proposer interface and the worker-side choice of who may speculate.

A proposer is built once per worker, ``proposer_cls(spec_config, model_runner)``, and asked after
every step for the drafts of the requests that sampled a token (``propose``). Proposing in the
worker, after sampling, is vLLM's choice and the one that lets every kind of proposer plug in the
same way: the token history is already there in the persistent batch (n-gram), and so are the
target's hidden states and the device (a draft model or an EAGLE head, later).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sparrow.sampling_params import SamplingParams
from sparrow.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from sparrow.spec_decode.draft_model import DraftStep


class SpecProposer:
    """Base class of every proposer (the ``sparrow_register_spec_proposers`` hook's contract)."""

    def __init__(self, spec_config: SpeculativeConfig, model_runner: Any) -> None:
        self.spec_config = spec_config
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.model_runner = model_runner
        # Set by the worker before each propose: the step's AttentionMetadata. Row r's tokens this
        # step are hidden_states[query_start_loc_cpu[r]:query_start_loc_cpu[r + 1]], at positions
        # up to seq_lens_cpu[r] - 1 (those past the request's accepted tokens were rejected drafts).
        self.step_metadata: Any = None

    def propose(self, rows: Sequence[int], token_ids: np.ndarray, num_tokens: np.ndarray,
                hidden_states: Any = None) -> list[list[int]]:
        """Drafts for the persistent batch's ``rows``, one list each (at most
        ``num_speculative_tokens`` ids, maybe empty).

        ``token_ids``: [max_num_reqs, max_model_len] int64, row r's prompt and output in its first
        ``num_tokens[r]`` columns (the token just sampled included). ``hidden_states``: the target's
        [num_tokens_this_step, hidden] output of the step, for proposers that read it.
        """
        raise NotImplementedError

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of KV cache of its own this proposer keeps per block of the target's cache (a
        draft model's layers; 0: none). The worker sizes the target's cache so both fit."""
        return 0

    def kv_cache_fixed_bytes(self) -> int:
        """Bytes of KV cache of its own this proposer keeps whatever the target's block count
        (0: none); the worker takes them out of the KV budget before sizing the target's cache."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:  # noqa: B027 - optional hook
        """Called once the target's cache has ``num_blocks`` blocks (allocate one's own here)."""

    def graph_forwards(self) -> list[ProposerForward]:
        """The model forwards this proposer runs through :class:`ProposerForward`, which a
        platform may capture as graphs once the caches exist (CUDA: sparrow_cuda.cuda_graphs)."""
        return []


class ProposerForward:
    """One of a proposer's model forwards, which a platform may replay from captured graphs.

    ``forward(input_ids, positions, metadata, *extras)`` runs ``model`` (it has ``attn_backend``)
    over the KV caches of ``cache`` (``cache.kv_caches``) and returns the [T, hidden] states;
    ``extras`` are its per-token inputs beyond ids and positions, one ``(row shape, dtype)`` each
    (an EAGLE head's features). A step holds at most ``max_blocks_per_req`` blocks per request and
    ``max_len`` tokens per sequence. A platform that captures graphs sets ``graphs`` (an object
    with ``select``, ``replay`` and a ``replays`` counter, as sparrow_cuda's StepGraphs); a call
    then replays the smallest graph that holds the step, and runs eagerly otherwise.
    """

    def __init__(self, name: str, model: Any, forward: Callable[..., torch.Tensor], cache: Any, max_len: int,
                 max_blocks_per_req: int, extras: Sequence[tuple[tuple[int, ...], torch.dtype]] = ()) -> None:
        self.name = name
        self.model = model
        self.forward = forward
        self.cache = cache
        self.max_len = max_len
        self.max_blocks_per_req = max_blocks_per_req
        self.extras = tuple(extras)
        self.graphs: Any = None

    def __call__(self, step: DraftStep, *extras: torch.Tensor) -> torch.Tensor:
        metadata = step.metadata
        graphs = self.graphs
        if graphs is not None:
            shape = graphs.select(metadata.num_actual_tokens, metadata.num_reqs, metadata.max_query_len, False)
            if shape is not None:
                return graphs.replay(shape, step.input_ids, step.positions, metadata, extras=extras)
            graphs.replays["eager"] += 1
        self.model.attn_backend.prepare(metadata)
        return self.forward(step.input_ids, step.positions, metadata, *extras)


def may_speculate(params: SamplingParams, plugin_logits_processors: bool) -> bool:
    """Whether a request gets drafts.

    The verification step samples draft positions 1..k with temperature, min-p, top-k, top-p
    and the request's grammar mask only (position 0 goes through the full sampler; the engine
    core fills one grammar mask per draft position, after the drafts before it). So a request
    that needs anything else that depends on the tokens before each position does not
    speculate: penalties, the position-dependent logits processors (min_tokens, bad_words) and
    those the row-wise processor state owns (allowed_token_ids, logit_bias, thinking_token_budget,
    and any a plugin enabled: they may act on any request), and logprobs (they are reported from position 0's
    sampler only). Structured outputs do speculate.
    """
    return not (
        plugin_logits_processors
        or params.logprobs is not None
        or params.prompt_logprobs is not None
        or params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        or params.min_tokens > 0
        or params.bad_words or params.bad_words_token_ids
        or params.allowed_token_ids is not None
        or params.logit_bias
        or params.thinking_token_budget is not None
    )


def build_proposer(spec_config: dict[str, Any] | None, model_runner: Any) -> SpecProposer | None:
    """The proposer ``speculative_config["method"]`` names, or None when speculation is off."""
    if spec_config is None:
        return None
    from sparrow.plugins import get_registry, resolve_parser

    config = SpeculativeConfig(**spec_config)
    proposer_cls = resolve_parser("speculative proposer", config.method, get_registry().spec_proposers)
    return proposer_cls(config, model_runner)
