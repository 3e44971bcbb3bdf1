"""Token embedding and LM head, with the vocabulary split across tensor-parallel ranks.

Rank r holds rows ``[r * vocab_per_rank, (r + 1) * vocab_per_rank)`` of the table; the vocabulary
is padded up to a multiple of the world size and the padded rows are zero. With world size 1 the
layers are a plain ``F.embedding`` / ``F.linear``.

Both are registered ops (``embedding``, ``lm_head``) whose call covers this rank's shard only; the
all-reduce / all-gather across ranks stays in the layer, around the op call.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.layers.parallel import ParallelContext, copy_checked, loaded_shape, narrow_loaded, resolve_tp
from sparrow.ops.base import CustomOp


class VocabParallelEmbedding(CustomOp):
    """Token ids -> embedding rows. The op call ``(input_ids) -> [num_tokens, dim]`` gives the rows
    of the ids in this rank's vocabulary shard and zeros for the others; ``forward`` sums the
    ranks' parts."""

    op_name = "embedding"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp: ParallelContext | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = resolve_tp(tp)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_per_rank = -(-num_embeddings // self.tp.world_size)
        self.vocab_start = self.tp.rank * self.vocab_per_rank
        self.vocab_end = min(self.vocab_start + self.vocab_per_rank, num_embeddings)
        # Uninitialised on purpose: load_weights overwrites it (padding rows are zeroed then).
        self.weight = nn.Parameter(
            torch.empty(self.vocab_per_rank, embedding_dim, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [num_tokens] int64 -> [num_tokens, embedding_dim]
        impl = self._op_impl
        out = impl(input_ids) if impl is not None else self.forward_native(input_ids)
        if self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
        return out

    def forward_native(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        return F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        """Copy this rank's vocabulary rows of the full ``[vocab, dim]`` table into ``param``."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        shape = loaded_shape(loaded)
        if shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"checkpoint shape {shape} does not match the model's "
                f"({self.num_embeddings}, {self.embedding_dim})"
            )
        num_rows = self.vocab_end - self.vocab_start
        table = param.detach()  # not .data: the copy moves the parameter's version counter, which tells a
        # tied LM head that keeps a packed copy of this table to pack it again
        copy_checked(table[:num_rows], narrow_loaded(loaded, 0, self.vocab_start, num_rows))
        table[num_rows:].zero_()

    def layer_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings}, dim={self.embedding_dim}, "
            f"rows={self.vocab_start}:{self.vocab_end}, tp={self.tp.rank}/{self.tp.world_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocabulary logits; may share its weight with the embedding.

    The op call ``(hidden_states [T, hidden]) -> [T, vocab_per_rank]`` float32 is this rank's
    shard of the logits, padded rows included; ``compute_logits`` gathers the shards and drops
    the padding.
    """

    op_name = "lm_head"
    # Whether the weight is the embedding's table (an implementation that repacks it must leave
    # the shared dense tensor in place).
    tied = False

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use ``embedding``'s table as this head's weight (tied word embeddings)."""
        if (embedding.num_embeddings, embedding.embedding_dim) != (self.num_embeddings, self.embedding_dim):
            raise ValueError("tied embeddings need the embedding and LM head to have the same shape")
        self.weight = embedding.weight
        self.tied = True

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [num_tokens, hidden] -> [num_tokens, vocab] float32
        impl = self._op_impl
        logits = impl(hidden_states) if impl is not None else self.forward_native(hidden_states)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.num_embeddings]
        return logits

    forward = compute_logits

    def forward_native(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight).float()


# A step's prompt embeddings: flat token positions [K] int64 and the rows they take [K, hidden].
PromptEmbeds = tuple[torch.Tensor, torch.Tensor]


def with_prompt_embeds(hidden_states: torch.Tensor, prompt_embeds: PromptEmbeds | None) -> torch.Tensor:
    """``hidden_states`` [T, hidden] (the token embeddings) with the rows of prompts given as
    embeddings (vLLM's prompt_embeds) put in place; unchanged when there are none."""
    if prompt_embeds is None:
        return hidden_states
    rows, values = prompt_embeds
    return hidden_states.index_copy(0, rows, values.to(hidden_states.dtype))
