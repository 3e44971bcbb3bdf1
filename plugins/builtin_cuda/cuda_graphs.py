"""CUDA graphs for every step shape the attention backend can replay: decode, verification, mixed.

A step's host cost is mostly kernel launches. At start-up the runner captures the model's forward
once per *graph shape* on static input buffers and replays the smallest shape that holds a step.
A shape is ``GraphShape(family, num_tokens, num_reqs, max_query_len, lora)``; three families are
captured:

    decode   (bs, bs, 1)               bs in 1, 2, 4, 8, 16, 32, ... max_num_seqs
    verify   (bs * (k + 1), bs, k + 1) with speculative decoding of k tokens: every verification
                                       step of up to bs requests (each 1..k+1 tokens)
    mixed    (T, min(T, R), T)         T in 8 .. 512 tokens: any step of up to T tokens (chunked
                                       prefill beside decodes, a short prompt), R = max_num_seqs

and each again with ``lora=True`` when LoRA is enabled: the adapter hooks are captured reading
the static token -> slot buffer (the Triton segment GEMMs read nothing back to the host), and a
step whose tokens use adapters replays those. ``max_query_len`` is what the captured attention was
told: it only picks tile sizes and the KV split count (decode and verify graphs split long
contexts over programs), never the result.

Which families a backend gets is its ``graph_support`` (sparrow.attention): "always" (the Triton
backend: one kernel reads the step's layout from device tensors alone) gets all three, "decode"
the decode family (FlashInfer, which re-plans its graph-mode wrappers before each replay in
``prepare_graph_step``), "never" none.

Padding, one rule for every shape: requests past the step's real ones have no query tokens
(``query_start_loc`` repeats the real token count, ``seq_len`` 0) and tokens past the real ones
belong to no request (slot -1: nothing is written to the KV cache). Every layer outside attention
works row by row, so a padding row's output (never read) touches no real row. The real rows come
out of the graph in the step's own layout, so sampling is unchanged.

A speculative proposer's own forwards (a draft model's, an EAGLE head's: its ``graph_forwards``)
get a ``StepGraphs`` each, over their own caches, with the decode and mixed families: each drafted
token is a decode step, a catch-up or window step a mixed one. An EAGLE head also reads the
target's hidden states per token: such inputs are the static buffers' ``extras``.

``StepGraphs`` takes the graph type, its capture context and a synchronize function, so tests run
the whole capture/select/replay path on the CPU with a stand-in graph (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from sparrow.attention import AttentionMetadata
from sparrow_cuda.graph_probe import ProbeStep, probe_step  # noqa: F401 - probe_step: re-exported

logger = logging.getLogger(__name__)

# The largest step the mixed family captures, in tokens (vLLM's default capture limit too):
# larger steps are compute-bound, so launches cost them little.
MAX_MIXED_TOKENS = 512
_MIXED_TOKEN_SIZES = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


class GraphShape(NamedTuple):
    family: str  # "decode", "verify" or "mixed"
    num_tokens: int  # token rows of the captured forward
    num_reqs: int  # request rows (query_start_loc has one more)
    max_query_len: int  # what the captured attention was told: tiles and splits only
    lora: bool  # whether the adapter hooks were captured


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 513, 16))
    return [s for s in sizes if s <= max_num_seqs] or [1]


def graph_shapes(graph_support: str, max_num_seqs: int, max_num_batched_tokens: int,
                 num_speculative_tokens: int = 0, lora: bool = False) -> list[GraphShape]:
    """The shapes to capture for a backend's ``graph_support``: decode, then verify (with
    speculative decoding), then mixed ("always" only); with ``lora``, each twice."""
    if graph_support not in ("always", "decode", "never"):
        raise ValueError(f"graph_support must be 'always', 'decode' or 'never', got {graph_support!r}")
    if graph_support == "never":
        return []
    batch_sizes = graph_batch_sizes(max_num_seqs)
    shapes = [GraphShape("decode", bs, bs, 1, False) for bs in batch_sizes]
    if graph_support == "always":
        q = num_speculative_tokens + 1
        if q > 1:
            shapes += [GraphShape("verify", bs * q, bs, q, False) for bs in batch_sizes
                       if bs * q <= max_num_batched_tokens]
        limit = min(MAX_MIXED_TOKENS, max_num_batched_tokens)
        shapes += [GraphShape("mixed", t, min(t, max_num_seqs), t, False) for t in _MIXED_TOKEN_SIZES
                   if t <= limit]
    if lora:
        shapes += [shape._replace(lora=True) for shape in shapes]
    return shapes


class StaticInputs:
    """The buffers every captured forward reads, sized for the largest shape."""

    def __init__(self, max_tokens: int, max_reqs: int, block_table: torch.Tensor, device: torch.device,
                 lora: bool, host_layout: bool = False,
                 extras: Sequence[tuple[tuple[int, ...], torch.dtype]] = ()) -> None:
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        # The runner's persistent device block table itself (sparrow.worker.input_buffers): a replay
        # reads it with no copy. Rows past a step's requests hold other rows' blocks, never read.
        self.block_table = block_table
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device) if lora else None
        # Host copies of query_start_loc and seq_lens, padded alike, for a backend that plans a
        # replay on the host (AttentionBackend.graph_needs_host_layout).
        self.host_layout = host_layout
        self.query_start_loc_cpu = torch.zeros(max_reqs + 1, dtype=torch.int32)
        self.seq_lens_cpu = torch.zeros(max_reqs, dtype=torch.int32)
        # Per-token inputs beyond ids and positions (an EAGLE head's features), one row shape and
        # dtype each. Padding rows keep whatever they held: every layer outside attention works
        # row by row, so they touch no real row.
        self.extras = [torch.zeros(max_tokens, *shape, dtype=dtype, device=device) for shape, dtype in extras]

    def metadata(self, shape: GraphShape, max_seq_len: int) -> AttentionMetadata:
        t, r = shape.num_tokens, shape.num_reqs
        return AttentionMetadata(
            num_actual_tokens=t, num_reqs=r, max_query_len=shape.max_query_len, max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[: r + 1], seq_lens=self.seq_lens[:r],
            block_table=self.block_table[:r], slot_mapping=self.slot_mapping[:t],
            query_start_loc_cpu=self.query_start_loc_cpu[: r + 1] if self.host_layout else None,
            seq_lens_cpu=self.seq_lens_cpu[:r] if self.host_layout else None,
            is_decode_only=shape.max_query_len == 1,
        )

    def fill(self, shape: GraphShape, input_ids: torch.Tensor, positions: torch.Tensor,
             metadata: AttentionMetadata, token_slots: torch.Tensor | None,
             extras: Sequence[torch.Tensor] = ()) -> None:
        """Write a step's inputs (T tokens, R requests) for ``shape``, padded as the module says."""
        t, r = metadata.num_actual_tokens, metadata.num_reqs
        self.input_ids[:t].copy_(input_ids[:t])
        self.positions[:t].copy_(positions[:t])
        if len(extras) != len(self.extras):
            raise ValueError(f"a step of these graphs takes {len(self.extras)} extra inputs, got {len(extras)}")
        for static, value in zip(self.extras, extras):
            static[:t].copy_(value[:t])
        self.slot_mapping[:t].copy_(metadata.slot_mapping[:t])
        if t < shape.num_tokens:
            self.slot_mapping[t: shape.num_tokens].fill_(-1)
        _pad_layout(self.query_start_loc, self.seq_lens, metadata.query_start_loc, metadata.seq_lens, t, r, shape)
        if self.host_layout:
            assert metadata.query_start_loc_cpu is not None and metadata.seq_lens_cpu is not None
            _pad_layout(self.query_start_loc_cpu, self.seq_lens_cpu, metadata.query_start_loc_cpu,
                        metadata.seq_lens_cpu, t, r, shape)
        if metadata.block_table.data_ptr() != self.block_table.data_ptr():  # not the persistent table
            self.block_table[:r, : metadata.block_table.shape[1]].copy_(metadata.block_table[:r])
        if self.token_slots is not None and shape.lora:
            assert token_slots is not None, "a LoRA step comes with its token slots"
            self.token_slots[:t].copy_(token_slots[:t])
            if t < shape.num_tokens:
                self.token_slots[t: shape.num_tokens].fill_(-1)

    def clear(self) -> None:
        """Every request empty and every token padding: what a capture runs on."""
        self.slot_mapping.fill_(-1)
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.query_start_loc_cpu.zero_()
        self.seq_lens_cpu.zero_()
        if self.token_slots is not None:
            self.token_slots.fill_(-1)


def _pad_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, step_query_start_loc: torch.Tensor,
                step_seq_lens: torch.Tensor, t: int, r: int, shape: GraphShape) -> None:
    """A step's R requests over T tokens, then empty requests up to the shape's count."""
    query_start_loc[: r + 1].copy_(step_query_start_loc[: r + 1])
    seq_lens[:r].copy_(step_seq_lens[:r])
    if r < shape.num_reqs:
        query_start_loc[r + 1: shape.num_reqs + 1].fill_(t)
        seq_lens[r: shape.num_reqs].fill_(0)


class StepGraphs:
    """The captured forwards of one model runner and the choice of one for a step.

    ``forward(input_ids, positions, metadata, *extras)`` is the model's forward over its KV caches
    (``extras``: the static inputs' extra per-token tensors, sliced to the step's rows);
    ``lora_state`` (sparrow.lora.layers.StepLoRAState, or None) is switched on while LoRA shapes
    are captured. ``new_graph``, ``graph_context(graph, pool)`` and ``synchronize`` default to
    torch.cuda's; ``pool`` is shared by every graph (largest first, so smaller ones reuse it).

    ``probe(shape)`` (optional) builds a real step smaller than ``shape`` (:func:`probe_step`):
    after capture, every family replays one, padded, against the eager forward on the same
    inputs, and a family whose replay differs is dropped (eager), with a warning. A graph that
    replayed stale state (a plan made on the host at capture) is caught at start-up this way.
    """

    def __init__(self, shapes: list[GraphShape], static: StaticInputs, max_seq_len: int,
                 forward: Callable[..., torch.Tensor],
                 lora_state: Any = None, *, new_graph: Callable[[], Any] | None = None,
                 graph_context: Callable[[Any, Any], Any] | None = None,
                 synchronize: Callable[[], None] | None = None, pool: Any = None,
                 probe: Callable[[GraphShape], ProbeStep | None] | None = None,
                 prepare_graph_step: Callable[[AttentionMetadata, bool], None] | None = None,
                 what: str = "the model") -> None:
        self.shapes = shapes
        self.what = what  # whose forward, for the log: "the model", "the draft model", ...
        self.static = static
        self.max_seq_len = max_seq_len
        self.forward = forward
        self.lora_state = lora_state
        self.new_graph = new_graph or torch.cuda.CUDAGraph
        self.graph_context = graph_context or (lambda graph, pool: torch.cuda.graph(graph, pool=pool))
        self.synchronize = synchronize or torch.cuda.synchronize
        self.pool = pool
        self.probe = probe
        self.prepare_graph_step = prepare_graph_step  # the backend's (AttentionBackend.prepare_graph_step)
        self.metadata: dict[GraphShape, AttentionMetadata] = {}  # shape -> its static metadata
        # (family, lora) -> the checked replay's largest difference from eager, relative to eager's scale
        self.checked: dict[tuple[str, bool], float] = {}
        self.graphs: dict[GraphShape, tuple[Any, torch.Tensor]] = {}  # shape -> (graph, static output)
        # lora -> [(query length the family holds (None: any), token counts, shapes)] in try order
        self._families: dict[bool, list[tuple[int | None, list[int], list[GraphShape]]]] = {}
        self.replays: dict[str, int] = {"decode": 0, "verify": 0, "mixed": 0, "eager": 0}

    # -- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every shape, largest first; a family whose capture fails is left out (eager).
        Returns how many graphs were captured."""
        started = time.perf_counter()
        failed: set[tuple[str, bool]] = set()
        for shape in sorted(self.shapes, key=lambda s: (s.num_tokens, s.num_reqs), reverse=True):
            if (shape.family, shape.lora) in failed:
                continue
            try:
                self.graphs[shape] = self._capture_one(shape)
            except Exception as exc:  # noqa: BLE001 - graphs are an optimisation; eager always works
                logger.warning("CUDA graph capture of %s's %s steps%s failed, they run eagerly: %r",
                               self.what, shape.family, " with LoRA" if shape.lora else "", exc)
                failed.add((shape.family, shape.lora))
        if self.probe is not None:
            failed |= self._check_families()
        for shape in list(self.graphs):
            if (shape.family, shape.lora) in failed:
                del self.graphs[shape]
        self._index()
        if self.graphs:
            counts = collections.Counter(shape.family for shape in self.graphs)
            logger.info("captured %d CUDA graphs for %s (%s) in %.1fs", len(self.graphs), self.what,
                        ", ".join(f"{n} {name}" for name, n in counts.items()), time.perf_counter() - started)
        return len(self.graphs)

    def _capture_one(self, shape: GraphShape) -> tuple[Any, torch.Tensor]:
        static = self.static
        metadata = self.metadata[shape] = static.metadata(shape, self.max_seq_len)
        ids, positions = static.input_ids[: shape.num_tokens], static.positions[: shape.num_tokens]
        static.clear()
        if self.prepare_graph_step is not None:
            self.prepare_graph_step(metadata, True)
        state = self.lora_state
        if shape.lora:
            state.active, state.token_slots = True, static.token_slots[: shape.num_tokens]
        extras = [extra[: shape.num_tokens] for extra in static.extras]
        try:
            for _ in range(2):  # warm-up (Triton compilation, lazy inits) outside the capture
                self.forward(ids, positions, metadata, *extras)
            self.synchronize()
            graph = self.new_graph()
            with self.graph_context(graph, self.pool):
                output = self.forward(ids, positions, metadata, *extras)
        finally:
            if shape.lora:
                state.active, state.token_slots = False, None
        return graph, output

    def _check_families(self) -> set[tuple[str, bool]]:
        """Replay one probe step per captured family against the eager forward; the families
        whose replay differs."""
        wrong: set[tuple[str, bool]] = set()
        families: dict[tuple[str, bool], GraphShape] = {}
        for shape in sorted(self.graphs, key=lambda s: (s.num_reqs < 2, s.num_tokens)):
            families.setdefault((shape.family, shape.lora), shape)  # the smallest with room to pad
        for family, shape in families.items():
            assert self.probe is not None
            step = self.probe(shape)
            if step is None:
                continue
            state = self.lora_state
            if shape.lora:
                saved = state.active, state.token_slots
                state.active, state.token_slots = True, step.token_slots
            extras = self._probe_extras(step.metadata.num_actual_tokens)
            try:
                raw = self.forward(step.input_ids, step.positions, step.metadata, *extras)
                eager = raw[: step.metadata.num_actual_tokens].float().clone()
            finally:
                if shape.lora:
                    state.active, state.token_slots = saved
            replayed = self._run(shape, step.input_ids, step.positions, step.metadata, step.token_slots,
                                 extras).float()
            scale = float(eager.abs().max().clamp(min=1e-6))
            error = float((replayed - eager).abs().max()) / scale
            self.checked[family] = error
            tolerance = 1e-3 if raw.dtype == torch.float32 else 5e-2
            if not error <= tolerance:  # NaN included
                logger.warning("CUDA graphs of %s's %s steps%s replay a probe step %.3g away from eager "
                               "(relative); they run eagerly", self.what, shape.family,
                               " with LoRA" if shape.lora else "", error)
                wrong.add(family)
        return wrong

    def _probe_extras(self, num_tokens: int) -> list[torch.Tensor]:
        """Extra inputs for a probe step: standard normal values from a fixed seed."""
        generator = torch.Generator().manual_seed(1)
        return [torch.randn(num_tokens, *extra.shape[1:], generator=generator).to(extra)
                for extra in self.static.extras]

    def _index(self) -> None:
        """Per LoRA flag, the families in the order a step tries them (decode, verify, mixed),
        each as its shapes sorted by token count."""
        self._families = {}
        for lora in (False, True):
            for family in ("decode", "verify", "mixed"):
                shapes = sorted((s for s in self.graphs if s.family == family and s.lora == lora),
                                key=lambda s: (s.num_tokens, s.num_reqs))
                if shapes:
                    self._families.setdefault(lora, []).append(
                        (shapes[0].max_query_len if family != "mixed" else None, [s.num_tokens for s in shapes],
                         shapes))

    # -- the step ---------------------------------------------------------------------------
    def select(self, num_tokens: int, num_reqs: int, max_query_len: int, lora: bool) -> GraphShape | None:
        """The smallest captured shape that holds a step, or None (eager): decode and verify
        graphs hold steps whose every query fits their query length, mixed graphs any step of up
        to their token and request counts."""
        for query_len, tokens, shapes in self._families.get(lora, ()):
            if query_len is not None and max_query_len > query_len:
                continue
            for index in range(bisect.bisect_left(tokens, num_tokens), len(shapes)):
                if shapes[index].num_reqs >= num_reqs:
                    return shapes[index]
        return None

    def replay(self, shape: GraphShape, input_ids: torch.Tensor, positions: torch.Tensor,
               metadata: AttentionMetadata, token_slots: torch.Tensor | None = None,
               extras: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """Fill the static inputs for ``shape``, replay it; the real rows' hidden states."""
        self.replays[shape.family] += 1
        return self._run(shape, input_ids, positions, metadata, token_slots, extras)

    def _run(self, shape: GraphShape, input_ids: torch.Tensor, positions: torch.Tensor,
             metadata: AttentionMetadata, token_slots: torch.Tensor | None,
             extras: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        self.static.fill(shape, input_ids, positions, metadata, token_slots, extras)
        if self.prepare_graph_step is not None:
            self.prepare_graph_step(self.metadata[shape], False)
        graph, output = self.graphs[shape]
        graph.replay()
        return output[: metadata.num_actual_tokens]
