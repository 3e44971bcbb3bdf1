"""CUDA graphs for decode, verification and mixed steps (sparrow_cuda.cuda_graphs), run on the CPU.

The CUDA runner's capture, choice of graph, padding and copy-back run here unchanged on a CPU
engine, with two stand-ins: a graph whose replay runs the captured shape's forward again on the
static buffers and writes the captured output tensor (data flows as through a real graph: static
inputs in, the capture's own output tensor out), and a paged torch attention backend that, like
the Triton one, reads the step's whole layout from the metadata's tensors (graph_support
"always"). The same engine without graphs, with the same backend, is the reference: greedy tokens
identical and logprobs within 1e-4, for chunked prefill beside decodes, n-gram speculation
(verification steps) and a batch mixing two LoRA adapters with the base model. The Triton
kernel's behaviour on a padded step is checked in tests/test_triton_kernels.py (interpreted);
the real graphs on a GPU in the `cuda` test at the end.
"""

from __future__ import annotations

import contextlib
import functools
import random
import types

import pytest
import torch

from sparrow import LLM, SamplingParams
from sparrow.attention import AttentionBackend
from sparrow.hookspecs import hookimpl
from sparrow.layers.attention import Attention
from sparrow.plugins import get_plugin_manager, register_plugin
from sparrow.spec_decode.proposer import SpecProposer
from sparrow_cuda.cuda_graphs import GraphShape, StaticInputs, StepGraphs, graph_shapes, probe_step
from sparrow_cuda.model_runner import CudaModelRunner


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


class PagedReference(AttentionBackend):
    """Causal paged attention in plain torch that reads everything from the metadata's tensors."""

    name = "paged-reference"
    graph_support = "always"

    def forward(self, query, key, value, kv_cache, metadata):
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        slots = metadata.slot_mapping[: query.shape[0]]
        write = torch.nonzero(slots >= 0).squeeze(1)
        for side, new in ((0, key), (1, value)):
            kv_cache[side].view(-1, num_kv_heads, head_dim).index_copy_(0, slots[write], new[write])
        out = torch.zeros_like(query)
        starts = metadata.query_start_loc.tolist()
        block_size = kv_cache.shape[2]
        group = self.num_heads // num_kv_heads
        for i, seq_len in enumerate(metadata.seq_lens.tolist()):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            blocks = metadata.block_table[i, : -(-seq_len // block_size)].long()
            keys = kv_cache[0][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, 1)
            values = kv_cache[1][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), keys.float()) * self.scale
            query_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
            scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.float()).to(out.dtype)
        return out


def use_reference_backend(model) -> None:
    """Give ``model`` (a runner's model, a draft model, an EAGLE head) a PagedReference backend."""
    old = model.attn_backend
    backend = PagedReference(old.num_heads, old.num_kv_heads, old.head_dim, old.scale, old.dtype, old.device)
    model.attn_backend = backend
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend


class ReplayingGraph:
    """A stand-in CUDAGraph: a replay runs its shape's forward again on the static buffers (the
    adapter hooks reading the static token slots, as a graph captured with them does) and writes
    the captured output tensor."""

    def __init__(self, owner: list) -> None:
        self.owner = owner  # [StepGraphs], filled once it exists

    def replay(self) -> None:
        graphs: StepGraphs = self.owner[0]
        shape, (_, output) = next((s, entry) for s, entry in graphs.graphs.items() if entry[0] is self)
        static = graphs.static
        state = graphs.lora_state
        if shape.lora:
            saved = state.active, state.token_slots
            state.active, state.token_slots = True, static.token_slots[: shape.num_tokens]
        try:
            fresh = graphs.forward(static.input_ids[: shape.num_tokens], static.positions[: shape.num_tokens],
                                   graphs.metadata[shape],  # the capture's metadata, as a graph holds it
                                   *(extra[: shape.num_tokens] for extra in static.extras))
        finally:
            if shape.lora:
                state.active, state.token_slots = saved
        output.copy_(fresh)


class StaleGraph(ReplayingGraph):
    """Replays what the capture saw, not the step: the inputs of the capture (an empty step) are
    put back for the replay, as a graph that holds host-made state from its capture would."""

    def replay(self) -> None:
        graphs: StepGraphs = self.owner[0]
        static = graphs.static
        saved = [t.clone() for t in (static.query_start_loc, static.seq_lens, static.slot_mapping)]
        static.clear()
        try:
            super().replay()
        finally:
            for tensor, value in zip((static.query_start_loc, static.seq_lens, static.slot_mapping), saved):
                tensor.copy_(value)


def stand_in(build, graph_cls=ReplayingGraph) -> StepGraphs:
    """``build(**graph_kwargs)`` (a CUDA runner's graph builder) with the stand-in graph, captured."""
    owner: list = []
    graphs = build(new_graph=lambda: graph_cls(owner), graph_context=lambda graph, pool: contextlib.nullcontext(),
                   synchronize=lambda: None)
    assert graphs is not None
    owner.append(graphs)
    graphs.capture()
    return graphs


def attach_graphs(llm, graph_cls=ReplayingGraph) -> StepGraphs:
    """Give a CPU engine's runner the CUDA runner's graphs (stand-in graph type) and run_model,
    and its speculative proposer's forwards theirs."""
    runner = runner_of(llm)
    runner.step_graphs = None
    graphs = runner.step_graphs = stand_in(functools.partial(CudaModelRunner.build_step_graphs, runner), graph_cls)
    runner.run_model = types.MethodType(CudaModelRunner.run_model, runner)
    for forward in runner.proposer.graph_forwards() if runner.proposer is not None else ():
        forward.graphs = stand_in(functools.partial(CudaModelRunner.build_proposer_graphs, runner, forward), graph_cls)
    return graphs


def use_reference_backends(llm) -> None:
    """The reference backend for the runner's model and every model its proposer runs."""
    runner = runner_of(llm)
    use_reference_backend(runner.model)
    for forward in runner.proposer.graph_forwards() if runner.proposer is not None else ():
        use_reference_backend(forward.model)


def summary(outputs) -> list[tuple[list[int], list[float]]]:
    """Per request: its tokens and, when it asked for them, their logprobs."""
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs or (), o.outputs[0].token_ids)])
            for o in outputs]


def assert_same(got, want, atol: float = 1e-4) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        assert len(logprobs) == len(ref_logprobs)
        assert all(abs(a - b) < atol for a, b in zip(logprobs, ref_logprobs))


def prompts(qwen3_dir, lengths, seed=0) -> list[dict]:
    from sparrow.model_loader import get_hf_config

    vocab_size = get_hf_config(qwen3_dir).vocab_size
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(8, vocab_size - 8) for _ in range(n)]} for n in lengths]


def run_both(qwen3_dir, requests, params, generate_kwargs=None, graph_cls=ReplayingGraph, **engine_args):
    """(eager summary, graph summary, the graph engine's replay counts); every captured family's
    start-up check against eager must have passed."""
    engine_args = dict(multiprocess=False, dtype="float32", max_model_len=256, block_size=16, **engine_args)
    results = []
    for graphs_on in (False, True):
        with LLM(qwen3_dir, **engine_args) as llm:
            use_reference_backends(llm)
            graphs = attach_graphs(llm, graph_cls) if graphs_on else None
            results.append(summary(llm.generate(requests, params, use_tqdm=False, **(generate_kwargs or {}))))
            replays = dict(graphs.replays) if graphs else None
    if graph_cls is ReplayingGraph:
        assert {family for family, _ in graphs.checked} == {shape.family for shape in graphs.shapes}
        assert max(graphs.checked.values()) < 1e-5, graphs.checked
    return results[0], results[1], replays


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
# Requests asking for logprobs do not speculate (sparrow.spec_decode.proposer.may_speculate).
GREEDY_SPEC = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


# -- which graphs --------------------------------------------------------------------------------

def test_graph_shapes_per_backend_support():
    always = graph_shapes("always", 64, 256, num_speculative_tokens=3, lora=True)
    families = {(s.family, s.lora) for s in always}
    assert families == {(f, lora) for f in ("decode", "verify", "mixed") for lora in (False, True)}
    assert all(s.num_tokens == s.num_reqs * 4 and s.max_query_len == 4 for s in always if s.family == "verify")
    assert max(s.num_tokens for s in always if s.family == "mixed") == 256  # capped by the token budget
    assert all(s.num_reqs <= 64 for s in always)
    decode = graph_shapes("decode", 64, 256, num_speculative_tokens=3)
    assert {s.family for s in decode} == {"decode"} and [s.num_reqs for s in decode] == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_shapes("never", 64, 256) == []
    with pytest.raises(ValueError, match="graph_support"):
        graph_shapes("sometimes", 64, 256)


def test_a_step_gets_the_smallest_graph_that_holds_it():
    shapes = graph_shapes("always", 32, 512, num_speculative_tokens=2, lora=True)
    static = StaticInputs(max(s.num_tokens for s in shapes), 32, torch.zeros(32, 4, dtype=torch.int32),
                          torch.device("cpu"), lora=True)
    lora_state = types.SimpleNamespace(active=False, token_slots=None)
    graphs = StepGraphs(shapes, static, 64, lambda ids, positions, metadata: ids.float().unsqueeze(1), lora_state,
                        new_graph=object, graph_context=lambda graph, pool: contextlib.nullcontext(),
                        synchronize=lambda: None)
    assert graphs.capture() == len(shapes)
    assert graphs.select(3, 3, 1, False) == GraphShape("decode", 4, 4, 1, False)
    assert graphs.select(32, 32, 1, True) == GraphShape("decode", 32, 32, 1, True)
    # Verification: 5 requests, up to k + 1 = 3 tokens each.
    assert graphs.select(11, 5, 3, False) == GraphShape("verify", 24, 8, 3, False)
    # A query longer than k + 1 (a prompt chunk): the mixed family, by token count.
    assert graphs.select(11, 5, 4, False) == GraphShape("mixed", 16, 16, 16, False)
    assert graphs.select(40, 3, 38, False) == GraphShape("mixed", 48, 32, 48, False)
    assert graphs.select(513, 3, 500, False) is None  # past the largest: eager
    # A step using adapters never replays a graph captured without them, nor the reverse.
    assert graphs.select(11, 5, 4, True).lora and not graphs.select(11, 5, 4, False).lora
    assert graphs.select(3, 3, 1, True).family == "decode"


def test_a_family_that_fails_to_capture_runs_eagerly_alone():
    shapes = graph_shapes("always", 8, 64)

    def forward(ids, positions, metadata):
        if metadata.max_query_len > 1 and metadata.max_query_len == metadata.num_actual_tokens:
            raise RuntimeError("no mixed steps here")
        return ids.float().unsqueeze(1)

    static = StaticInputs(64, 8, torch.zeros(8, 4, dtype=torch.int32), torch.device("cpu"), lora=False)
    graphs = StepGraphs(shapes, static, 64, forward, new_graph=object,
                        graph_context=lambda graph, pool: contextlib.nullcontext(), synchronize=lambda: None)
    assert graphs.capture() == len([s for s in shapes if s.family == "decode"])
    assert graphs.select(4, 4, 1, False) is not None and graphs.select(10, 2, 9, False) is None


# -- the engine: graphs against eager, same backend -----------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_decode_and_mixed_steps_replay_graphs(qwen3_dir, async_scheduling):
    # Overlapped: the previous step's tokens are fed into the inputs on the device, before the fill.
    requests = prompts(qwen3_dir, (3, 40, 9, 70, 1, 25), seed=1)
    eager, graphs, replays = run_both(qwen3_dir, requests, GREEDY, max_num_batched_tokens=32, max_num_seqs=4,
                                      num_kv_blocks=40, async_scheduling=async_scheduling)
    assert_same(graphs, eager)
    assert replays["decode"] > 0 and replays["mixed"] > 0, replays


class UnevenProposer(SpecProposer):
    """Row r guesses that its last token repeats (r + step) % (k + 1) times: verification steps
    where requests verify 0..k drafts side by side (mostly rejected; the output is unchanged)."""

    step = 0

    def propose(self, rows, token_ids, num_tokens, hidden_states=None):
        UnevenProposer.step += 1
        k = self.num_speculative_tokens
        return [[int(token_ids[row, num_tokens[row] - 1])] * ((row + self.step) % (k + 1)) for row in rows]


class UnevenPlugin:
    @hookimpl
    def sparrow_register_spec_proposers(self, register):
        register("uneven", UnevenProposer)


@pytest.fixture
def uneven_proposer():
    pm = get_plugin_manager()
    register_plugin(pm, UnevenPlugin(), "uneven-proposer")
    yield {"method": "uneven", "num_speculative_tokens": 3}
    pm.unregister(name="uneven-proposer")


def test_a_graph_replaying_its_capture_is_caught_at_start_up(qwen3_dir, caplog):
    """A family whose probe replay differs from eager is dropped: every step runs eagerly."""
    requests = prompts(qwen3_dir, (3, 40, 9), seed=4)
    with caplog.at_level("WARNING", logger="sparrow_cuda.cuda_graphs"):
        eager, graphs, replays = run_both(qwen3_dir, requests, GREEDY, graph_cls=StaleGraph,
                                          max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=40)
    assert_same(graphs, eager)
    assert replays == {"decode": 0, "verify": 0, "mixed": 0, "eager": replays["eager"]} and replays["eager"] > 0
    assert "decode steps replay a probe step" in caplog.text and "mixed steps replay a probe step" in caplog.text


def test_verification_steps_replay_graphs(qwen3_dir, uneven_proposer):
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    requests = [{"prompt_token_ids": text * 4}, *prompts(qwen3_dir, (17, 4, 30), seed=2)]
    eager, graphs, replays = run_both(qwen3_dir, requests, GREEDY_SPEC, speculative_config=uneven_proposer,
                                      max_num_batched_tokens=64, num_kv_blocks=40)
    assert_same(graphs, eager)
    assert replays["verify"] > 0, replays


def check_proposer_graphs(qwen3_dir, tmp_path, method: str, device: str) -> None:
    """The proposer's forwards with and without graphs (stand-ins on the CPU, real ones on a GPU):
    the same drafts call by call, the same output, and both families replayed."""
    from sparrow.tiny.draft import build_draft_dir
    from sparrow.tiny.eagle import build_eagle_dir

    model = (build_draft_dir(qwen3_dir, tmp_path / "draft", num_layers=1) if method == "draft_model"
             else build_eagle_dir(qwen3_dir, tmp_path / "head"))
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    requests = [{"prompt_token_ids": text * 4}, *prompts(qwen3_dir, (17, 4, 30), seed=2)]
    engine_args = dict(multiprocess=False, device=device, dtype="float32", max_model_len=256, block_size=16,
                       max_num_batched_tokens=64, num_kv_blocks=40,
                       speculative_config={"method": method, "model": str(model), "num_speculative_tokens": 3})
    results = []
    for graphs_on in (False, True):
        with LLM(qwen3_dir, enforce_eager=not graphs_on, **engine_args) as llm:
            if device == "cpu":
                use_reference_backends(llm)
            proposer = runner_of(llm).proposer
            drafts: list[list[list[int]]] = []
            propose = proposer.propose

            def recording(*args, propose=propose, drafts=drafts, **kwargs):
                out = propose(*args, **kwargs)
                drafts.append([list(row) for row in out])
                return out

            proposer.propose = recording
            if graphs_on and device == "cpu":
                attach_graphs(llm)
            results.append((summary(llm.generate(requests, GREEDY_SPEC, use_tqdm=False)), drafts))
            (forward,) = proposer.graph_forwards()
            graphs = forward.graphs
    (eager, eager_drafts), (graphed, graphed_drafts) = results
    assert_same(graphed, eager)
    assert graphed_drafts == eager_drafts and sum(len(row) for call in eager_drafts for row in call) > 20
    assert graphs.replays["decode"] > 0 and graphs.replays["mixed"] > 0, graphs.replays
    assert set(graphs.checked) == {("decode", False), ("mixed", False)}
    assert max(graphs.checked.values()) < 1e-3, graphs.checked


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_draft_model_and_eagle_head_forwards_replay_graphs(qwen3_dir, tmp_path, method):
    """The proposer's own forwards (sparrow.spec_decode.proposer.ProposerForward) replay graphs of
    their own: the drafting steps of one token per request (decode) and the catch-up or window
    steps (mixed). The target's output cannot show a wrong draft (verification keeps the target's
    tokens), so the drafts themselves are compared, call by call."""
    check_proposer_graphs(qwen3_dir, tmp_path, method, "cpu")


def test_lora_steps_replay_graphs_captured_with_the_adapter_hooks(qwen3_dir, tmp_path):
    from sparrow.lora.request import LoRARequest
    from sparrow.tiny.lora import build_lora_adapter

    adapters = [LoRARequest(name, index + 1, str(build_lora_adapter(qwen3_dir, tmp_path / name, rank=8, alpha=16,
                                                                    seed=index + 1)))
                for index, name in enumerate(("a", "b"))]
    requests = prompts(qwen3_dir, (5, 30, 12, 3), seed=3)
    lora_requests = [adapters[0], None, adapters[1], adapters[0]]
    eager, graphs, replays = run_both(qwen3_dir, requests, GREEDY, {"lora_request": lora_requests},
                                      enable_lora=True, max_loras=2, max_lora_rank=8, max_num_batched_tokens=32,
                                      num_kv_blocks=40)
    assert_same(graphs, eager)
    assert replays["decode"] > 0 and replays["mixed"] > 0, replays
    # The adapters changed the output (so the graphs replayed the adapter path, not the base).
    with LLM(qwen3_dir, multiprocess=False, dtype="float32", max_model_len=256, block_size=16) as base:
        plain = summary(base.generate(requests, GREEDY, use_tqdm=False))
    assert plain[0][0] != graphs[0][0] and plain[2][0] != graphs[2][0]
    assert plain[1][0] == graphs[1][0]


# -- the real thing ---------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("case", ["mixed", "spec", "lora", "flashinfer"])
def test_cuda_graphs_equal_eager_on_a_gpu(qwen3_dir, tmp_path, uneven_proposer, case):
    """Real CUDA graphs: every family replays (Triton attention; FlashInfer's decode graphs, bf16)
    and gives the eager tokens."""
    engine_args = dict(multiprocess=False, device="cuda", dtype="float32", max_model_len=256,
                       max_num_batched_tokens=64, max_num_seqs=8)
    if case == "flashinfer":
        pytest.importorskip("flashinfer")
        engine_args.update(attention_backend="flashinfer", dtype="bfloat16")
    generate_kwargs = {}
    params = GREEDY
    requests = prompts(qwen3_dir, (3, 40, 9, 70, 1, 25), seed=1)
    if case == "spec":
        engine_args["speculative_config"] = uneven_proposer
        params = GREEDY_SPEC
    if case == "lora":
        from sparrow.lora.request import LoRARequest
        from sparrow.tiny.lora import build_lora_adapter

        adapter = LoRARequest("a", 1, str(build_lora_adapter(qwen3_dir, tmp_path / "a", rank=8, alpha=16, seed=1)))
        engine_args.update(enable_lora=True, max_loras=1, max_lora_rank=8)
        generate_kwargs = {"lora_request": [adapter if i % 2 else None for i in range(len(requests))]}
    results, replays = [], None
    for eager in (True, False):
        with LLM(qwen3_dir, enforce_eager=eager, **engine_args) as llm:
            results.append(summary(llm.generate(requests, params, use_tqdm=False, **generate_kwargs)))
            if not eager:
                replays = dict(runner_of(llm).step_graphs.replays)
    assert_same(results[1], results[0], atol=1e-4 if case != "flashinfer" else 5e-2)
    family = {"mixed": "mixed", "spec": "verify", "lora": "decode", "flashinfer": "decode"}[case]
    assert replays[family] > 0, replays


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_proposer_cuda_graphs_draft_what_eager_drafts_on_a_gpu(qwen3_dir, tmp_path, method):
    check_proposer_graphs(qwen3_dir, tmp_path, method, "cuda")


# -- FlashInfer's decode graphs, against a stand-in FlashInfer that attends from its buffers ------

class _FakeDecodeWrapper:
    """A FlashInfer decode wrapper in miniature: plan() keeps the page table (copied into the fixed
    buffers in graph mode, as FlashInfer does), run() attends over the pages it holds now."""

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        self.graph = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_heads, num_kv_heads, head_dim, page_size, **kwargs):
        if self.graph:
            indptr_buf, indices_buf, last_buf = self.buffers
            assert len(last_page_len) == len(last_buf), "FlashInfer: the batch size is fixed in graph mode"
            assert len(indices) <= len(indices_buf)
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)
        else:
            self.buffers = (indptr.clone(), indices.clone(), last_page_len.clone())
        self.scale, self.page_size = kwargs["sm_scale"], page_size

    def run(self, query, kv_cache, out):
        key_cache, value_cache = kv_cache
        indptr, indices, last_page_len = (t.tolist() for t in self.buffers)
        group = query.shape[1] // key_cache.shape[2]
        for row in range(len(last_page_len)):
            pages = indices[indptr[row]: indptr[row + 1]]
            length = (len(pages) - 1) * self.page_size + last_page_len[row]
            keys = key_cache[pages].flatten(0, 1)[:length].repeat_interleave(group, 1).float()
            values = value_cache[pages].flatten(0, 1)[:length].repeat_interleave(group, 1).float()
            weights = (torch.einsum("hd,khd->hk", query[row].float(), keys) * self.scale).softmax(-1)
            out[row] = torch.einsum("hk,khd->hd", weights, values).to(out.dtype)
        return out


def _flashinfer_graphs(monkeypatch, replan: bool):
    import sys

    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=lambda *args, **kwargs: None,
                                 BatchDecodeWithPagedKVCacheWrapper=_FakeDecodeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from sparrow_cuda.attention import FlashInferAttentionBackend

    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 8, 4, 40
    backend = FlashInferAttentionBackend(heads, kv_heads, head_dim, head_dim ** -0.5, torch.float32,
                                         torch.device("cpu"), block_size=block_size, workspace_bytes=16)

    def write(key, value, kv_cache, slots, k_scale, v_scale):
        keep = torch.nonzero(slots >= 0).squeeze(1)
        kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], key[keep])
        kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], value[keep])

    backend._ops = types.SimpleNamespace(reshape_and_cache=write)
    if not replan:  # a backend that plans a graph only for its capture
        monkeypatch.setattr(backend, "prepare_graph_step",
                            lambda metadata, capturing: FlashInferAttentionBackend.prepare_graph_step(
                                backend, metadata, capturing) if capturing else None)
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
    table = torch.Generator().manual_seed(5)
    qkv = torch.randn(64, (heads + 2 * kv_heads) * head_dim, generator=table)

    def forward(ids, positions, metadata):  # one attention layer over the ids' rows of a random table
        rows = qkv[(ids * 7 + positions) % 64]
        q, k, v = rows.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
        return backend.forward(q.reshape(-1, heads, head_dim), k.reshape(-1, kv_heads, head_dim),
                               v.reshape(-1, kv_heads, head_dim), kv_cache, metadata).flatten(1)

    shapes = graph_shapes(backend.graph_support, 8, 64)
    static = StaticInputs(8, 8, torch.zeros(8, 16, dtype=torch.int32), torch.device("cpu"), lora=False,
                          host_layout=backend.graph_needs_host_layout)
    owner: list = []
    probe = functools.partial(probe_step, block_size=block_size, num_blocks=num_blocks, max_blocks_per_req=16,
                              max_model_len=64, vocab_size=64, device=torch.device("cpu"))
    graphs = StepGraphs(shapes, static, 64, forward, new_graph=lambda: ReplayingGraph(owner),
                        graph_context=lambda graph, pool: contextlib.nullcontext(), synchronize=lambda: None,
                        probe=probe, prepare_graph_step=backend.prepare_graph_step)
    owner.append(graphs)
    graphs.capture()
    return graphs


def test_flashinfer_decode_graphs_replan_their_fixed_buffers_before_each_replay(monkeypatch):
    graphs = _flashinfer_graphs(monkeypatch, replan=True)
    assert {shape.family for shape in graphs.graphs} == {"decode"}
    assert graphs.checked[("decode", False)] < 1e-5


def test_flashinfer_decode_graphs_that_keep_the_capture_plan_are_caught(monkeypatch):
    graphs = _flashinfer_graphs(monkeypatch, replan=False)
    assert graphs.graphs == {} and graphs.checked[("decode", False)] > 1e-2
