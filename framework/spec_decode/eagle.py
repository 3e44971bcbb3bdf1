"""EAGLE-style speculative decoding: a one-layer head on the target's hidden states drafts k tokens.

    LLM(target_dir, speculative_config={"method": "eagle", "model": head_dir, "num_speculative_tokens": 4})

The head (EAGLE-1 layout, vLLM's ``EagleLlamaForCausalLM`` checkpoint names) reads, at position
i, the target's hidden state ``f_i`` and the embedding of the token after it, ``t_{i+1}``:

    x_i = fc(concat(embed(t_{i+1}), f_i))        fc: [2 * hidden] -> [hidden]
    h_i = llama_decoder_layer(x_i)               its own attention over the head's positions
    logits_i = lm_head(h_i)                      predicts t_{i+2}

``embed`` and ``lm_head`` are the target's (a head checkpoint's own copies are ignored). The head's
layer has no input norm unless the checkpoint holds one (``layers.0.input_layernorm.weight``:
EAGLE-1 drops it), q/k norms and QKV bias when the checkpoint has them, and a final norm before
``lm_head`` when it holds ``norm.weight``. Drafting then runs on the head's own states: draft
``d_{j+1}`` comes from ``x = fc(concat(embed(d_j), h_prev))``.

**No KV cache of its own (a window instead).** The head attends over the request's last
``EAGLE_WINDOW`` positions whose target hidden states the proposer has seen: each ``propose``
keeps the hidden states of the positions the target computed in the step and accepted (the
worker passes the step's metadata, so row r's are ``hidden_states[query_start_loc[r]:...]``),
then recomputes the head over the window in one batched forward (a scratch paged cache,
reused every call) and runs k - 1 batched single-token steps on it. Cost per step: up to
``EAGLE_WINDOW`` + k - 1 head tokens per request (one decoder layer), against a target step of
k + 1 tokens through every layer; in exchange there is no cache to keep consistent with
rejections, preemption or prefix caching. A request whose prompt was prefilled in chunks sees
only its last chunk's states (the worker proposes after sampling steps only), so its first
windows are shorter. The states of a request are dropped when its row leaves the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from sparrow.spec_decode.config import SpeculativeConfig
from sparrow.spec_decode.draft_model import DraftStep, PagedDraftCache
from sparrow.spec_decode.proposer import ProposerForward, SpecProposer

# Target hidden states kept per request: the head's attention context.
EAGLE_WINDOW = 64
# Head checkpoint tensors that the target provides.
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")


class EagleHead(nn.Module):
    """fc over concat(embedding, hidden state) -> one Llama decoder layer (-> optional norm)."""

    tie_word_embeddings = False  # what LlamaForCausalLM.load_weights, reused below, asks

    def __init__(self, hf_config: Any, names: set[str], target: Any, attn_backend_cls: type,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        from sparrow.layers.layernorm import RMSNorm
        from sparrow.layers.linear import ColumnParallelLinear
        from sparrow.layers.parallel import divide
        from sparrow.layers.rotary import get_rope
        from sparrow.models.llama import DecoderOptions, LlamaDecoderLayer, model_head_dim, num_kv_heads_per_rank

        self.config = hf_config
        tp = target.tp
        hidden, head_dim = hf_config.hidden_size, model_head_dim(hf_config)
        self.attn_backend = attn_backend_cls(
            divide(hf_config.num_attention_heads, tp.world_size, "num_attention_heads"),
            num_kv_heads_per_rank(hf_config.num_key_value_heads, tp), head_dim, head_dim ** -0.5, dtype, device)
        prefix = "layers.0.self_attn."
        options = DecoderOptions(qkv_bias=f"{prefix}q_proj.bias" in names, o_proj_bias=f"{prefix}o_proj.bias" in names,
                                 mlp_bias="layers.0.mlp.down_proj.bias" in names,
                                 qk_norm=f"{prefix}q_norm.weight" in names)
        with torch.device(device):
            # gather_output: every rank needs the whole input of the (tensor-parallel) layer.
            self.fc = ColumnParallelLinear(2 * hidden, hidden, "fc.bias" in names, tp=tp, gather_output=True,
                                           params_dtype=dtype)
            self.layers = nn.ModuleList([LlamaDecoderLayer(hf_config, options, self.attn_backend,
                                                           get_rope(hf_config, head_dim), 0, tp, dtype)])
            self.norm = RMSNorm(hidden, hf_config.rms_norm_eps, params_dtype=dtype) if "norm.weight" in names else None
        if "layers.0.input_layernorm.weight" not in names:
            self.layers[0].input_layernorm = nn.Identity()
        self._target = (target,)  # a tuple: the target's modules are not the head's parameters

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: Any) -> torch.Tensor:
        """input_ids, positions: [T]; features: [T, hidden] (the target's or the head's own
        states) -> the head's states [T, hidden]."""
        embeds = self._target[0].model.embed_tokens(input_ids)
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        hidden, residual = self.layers[0](positions, x, None, kv_caches[0], metadata)
        return hidden + residual

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            states = self.norm(states)
        return self._target[0].compute_logits(states)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        return 1, self.attn_backend.num_kv_heads, self.attn_backend.head_dim

    def checkpoint_names(self) -> dict[str, Any]:
        from sparrow.models.llama import LlamaForCausalLM

        return LlamaForCausalLM.checkpoint_names(self)  # type: ignore[arg-type]

    def load_weights(self, weights: Any) -> set[str]:
        from sparrow.models.llama import LlamaForCausalLM

        kept = ((name, tensor) for name, tensor in weights if name not in SHARED_WITH_TARGET)
        return LlamaForCausalLM.load_weights(self, kept)  # type: ignore[arg-type]


def checkpoint_tensor_names(model_dir: str) -> set[str]:
    from safetensors import safe_open

    from sparrow.model_loader import safetensors_files

    names: set[str] = set()
    for path, listed in safetensors_files(model_dir).items():
        if listed is not None:
            names.update(listed)
        else:
            with safe_open(str(path), framework="pt") as handle:
                names.update(handle.keys())
    return names


def load_eagle_head(model_dir: str, runner: Any) -> EagleHead:
    from sparrow.model_loader import get_hf_config, iter_safetensors
    from sparrow.models.llama import LlamaForCausalLM
    from sparrow.ops import bind_ops

    hf_config = get_hf_config(model_dir, runner.config.model.trust_remote_code)  # the target's setting
    target = runner.model
    if hf_config.hidden_size != target.config.hidden_size or hf_config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the EAGLE head {model_dir!r} (hidden_size "
                         f"{hf_config.hidden_size}, vocab_size {hf_config.vocab_size}) does not fit the target "
                         f"(hidden_size {target.config.hidden_size}, vocab_size {target.vocab_size})")
    with torch.no_grad():
        head = EagleHead(hf_config, checkpoint_tensor_names(model_dir), target, type(target.attn_backend),
                         runner.dtype, runner.device)
        loaded = head.load_weights(iter_safetensors(model_dir, target.tp))
        LlamaForCausalLM.check_loaded(head, loaded)  # type: ignore[arg-type]
    bind_ops(head, runner.config.device.device)
    return head.eval()


class _Window:
    __slots__ = ("state", "start", "features")

    def __init__(self, state: Any) -> None:
        self.state = state  # the runner's CachedRequestState (a resumed request gets a new one)
        self.start = 0  # position of features[0]
        self.features: torch.Tensor | None = None  # [m, hidden]: the target's states at start..start+m-1

    def extend(self, first: int, features: torch.Tensor, window: int) -> None:
        """Add the states of positions ``first..``; the older ones stay when they are contiguous."""
        if self.features is not None and self.start <= first <= self.start + self.features.shape[0]:
            features = torch.cat([self.features[: first - self.start], features])
            first = self.start
        else:
            features = features.clone()  # not a view that keeps the whole step's output alive
        drop = max(features.shape[0] - window, 0)
        self.features, self.start = features[drop:], first + drop


class EagleProposer(SpecProposer):
    def __init__(self, spec_config: SpeculativeConfig, model_runner: Any) -> None:
        super().__init__(spec_config, model_runner)
        assert spec_config.model is not None  # parse_speculative_config requires it
        self.head = load_eagle_head(spec_config.model, model_runner)
        self.window = EAGLE_WINDOW
        self.block_size = model_runner.block_size
        # Row i of a call uses scratch blocks [i * per_row, (i + 1) * per_row).
        self.blocks_per_row = -(-(self.window + self.num_speculative_tokens) // self.block_size)
        self.cache = PagedDraftCache(*self.head.kv_cache_spec(), self.block_size, model_runner.dtype,
                                     model_runner.device)
        self.cache.allocate(model_runner.max_num_reqs * self.blocks_per_row)
        self.windows: dict[str, _Window] = {}
        head = self.head
        self._forward = ProposerForward(
            "EAGLE head", head,
            lambda ids, positions, metadata, features: head(ids, positions, features, self.cache.kv_caches, metadata),
            self.cache, self.blocks_per_row * self.block_size, self.blocks_per_row,
            extras=[((head.config.hidden_size,), model_runner.dtype)])

    def graph_forwards(self) -> list[ProposerForward]:
        return [self._forward]

    def propose(self, rows: Sequence[int], token_ids: np.ndarray, num_tokens: np.ndarray,
                hidden_states: Any = None) -> list[list[int]]:
        runner, batch = self.model_runner, self.model_runner.batch
        if hidden_states is None or self.step_metadata is None:
            return [[] for _ in rows]
        for req_id, kept in list(self.windows.items()):
            row = batch.req_id_to_row.get(req_id)
            if row is None or batch.states[row] is not kept.state:
                del self.windows[req_id]  # finished, preempted or unscheduled
        query_start_loc = self.step_metadata.query_start_loc_cpu.numpy()
        seq_lens = self.step_metadata.seq_lens_cpu.numpy()
        out: list[list[int]] = [[] for _ in rows]
        plans: list[tuple[int, int, _Window, int]] = []  # (out index, row, window, last position)
        for out_index, row in enumerate(rows):
            state = batch.states[row]
            length = int(num_tokens[row])
            start = int(query_start_loc[row])
            first = int(seq_lens[row]) - (int(query_start_loc[row + 1]) - start)  # the step's first position
            last = length - 2  # the last position the target computed and kept: its state predicted the newest token
            if last < first or last + 1 >= runner.max_model_len:
                continue
            window = self.windows.get(state.req_id)
            if window is None:
                window = self.windows[state.req_id] = _Window(state)
            window.extend(first, hidden_states[start : start + last - first + 1], self.window)
            plans.append((out_index, row, window, last))
        if not plans:
            return out
        # The window: position p reads the target's state at p and the token at p + 1.
        tables = [list(range(i * self.blocks_per_row, (i + 1) * self.blocks_per_row)) for i in range(len(plans))]
        step = DraftStep(runner, self.block_size,
                         [token_ids[row, window.start + 1 : last + 2] for _, row, window, last in plans],
                         [0] * len(plans), tables, [window.start for _, _, window, _ in plans])
        features = torch.cat([window.features for _, _, window, _ in plans])  # type: ignore[misc]
        states = self._forward(step, features).index_select(0, step.last)
        drafted = self.head.compute_logits(states).argmax(dim=-1).tolist()
        for (out_index, *_), token in zip(plans, drafted):
            out[out_index].append(token)
        sizes = [last - window.start + 1 for _, _, window, last in plans]  # cache entries per row
        for j in range(1, self.num_speculative_tokens):
            active = [i for i, (_, _, _, last) in enumerate(plans) if last + j + 1 < runner.max_model_len]
            if not active:
                break
            step = DraftStep(runner, self.block_size, [np.array([out[plans[i][0]][-1]]) for i in active],
                             [sizes[i] + j - 1 for i in active], [tables[i] for i in active],
                             [plans[i][3] + 1 - sizes[i] for i in active])
            if len(active) < len(plans):
                states = states[runner.to_device(np.asarray(active, dtype=np.int64))]
            states = self._forward(step, states)
            drafted = self.head.compute_logits(states).argmax(dim=-1).tolist()
            for i, token in zip(active, drafted):
                out[plans[i][0]].append(token)
            plans = [plans[i] for i in active]
            tables = [tables[i] for i in active]
            sizes = [sizes[i] for i in active]
        return out
