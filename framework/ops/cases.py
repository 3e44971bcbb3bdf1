"""Conformance cases: small deterministic inputs for every kernel op.

Each op of :data:`sparrow.ops.KERNEL_OPS` names its cases function here
(``cases(dtype, device) -> list[OpCase]``); :mod:`sparrow.ops.check` runs a platform's
implementation and the torch reference on them and compares the outputs.

Sizes are small on purpose (a case runs in milliseconds on a CPU) but cover the shapes that break
kernels: 1, 5 and 37 rows (decode, small and ragged prefill), 2D and 3D inputs, partial rotary,
biases, the fused QKV and gate/up layers, and a padded vocabulary shard (tensor parallelism).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sparrow.layers.parallel import ParallelContext
from sparrow.ops.base import CustomOp

ROWS = (1, 5, 37)  # decode-sized, small and ragged prefill-sized inputs

# A custom comparison: (expected, got, args) -> (ok, detail).
Compare = Callable[[Any, Any, tuple], "tuple[bool, str]"]


@dataclass
class OpCase:
    """One input of one op, and how its output is judged."""

    op: str  # KERNEL_OPS name
    label: str  # what the input is, e.g. "residual, 5x64" (shown in the conformance table)
    make_layer: Callable[[], CustomOp] | None  # layer ops: a fresh layer with deterministic weights
    args: tuple  # the op call's inputs; run_case clones them before each call
    kwargs: dict = field(default_factory=dict)
    atol: float = 1e-5
    rtol: float = 1e-5
    exact: bool = False  # token ids, lookups, masks: compared with torch.equal
    compare: Compare | None = None  # replaces the tolerance comparison when the op allows choices


# -- tolerances --------------------------------------------------------------------------------

# (atol, rtol) for element-wise ops, whose reference and kernel round differently only at the end.
_ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
# GEMMs sum in a kernel-chosen order and tile shape (float32 without TF32, as the engine runs it).
_GEMM_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


def _tol(table: dict[torch.dtype, tuple[float, float]], dtype: torch.dtype) -> dict[str, Any]:
    atol, rtol = table.get(dtype, table[torch.bfloat16])
    return {"atol": atol, "rtol": rtol}


# -- deterministic inputs ----------------------------------------------------------------------

def _generator(*key: int) -> torch.Generator:
    seed = 0
    for part in key:
        seed = seed * 1000003 + part
    return torch.Generator(device="cpu").manual_seed(seed % (1 << 62))


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device,
           scale: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    # Drawn on the CPU in float32, so that every device and dtype sees the same values.
    return (torch.randn(*shape, generator=gen) * scale + mean).to(device=device, dtype=dtype)


def _load(param: torch.nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
    # Through the layer's own loader, as a checkpoint would be (padding rows, shards, ranks).
    param.weight_loader(param, full, shard_id)  # type: ignore[attr-defined]


def _layer_builder(build: Callable[[], CustomOp], fill: Callable[[CustomOp, torch.Generator], None],
                   dtype: torch.dtype, device: torch.device, seed: int) -> Callable[[], CustomOp]:
    def make_layer() -> CustomOp:
        with torch.device(device):
            layer = build()
        fill(layer, _generator(seed))
        # Loaded in float32, then cast, as a checkpoint is; buffers-only layers keep their dtype
        # (the rotary cos/sin cache is float32 whatever the model's dtype).
        if any(True for _ in layer.parameters()):
            layer.to(dtype=dtype)
        return layer
    return make_layer


# -- layer ops ---------------------------------------------------------------------------------

def linear_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    from sparrow.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    def fill(layer: Any, gen: torch.Generator) -> None:
        # The whole checkpoint tensor; the layer's loader keeps this rank's rows or columns.
        if isinstance(layer, RowParallelLinear):
            full_rows, full_cols = layer.output_size, layer.input_size_per_rank * layer.tp.world_size
        else:
            full_rows, full_cols = sum(s.full_size for s in layer.shards.values()), layer.input_size
        _load(layer.weight, torch.randn(full_rows, full_cols, generator=gen) / full_cols ** 0.5)
        if layer.bias is not None:
            _load(layer.bias, torch.randn(full_rows, generator=gen))

    layouts: list[tuple[str, Callable[[], CustomOp], bool]] = [
        # (label, build, whether forward passes the bias to the op)
        ("column+bias", lambda: ColumnParallelLinear(64, 48, bias=True), True),
        ("row", lambda: RowParallelLinear(48, 64, bias=False), False),
        ("qkv+bias", lambda: QKVParallelLinear(64, 16, 4, 2, bias=True), True),
        ("gate_up", lambda: MergedColumnParallelLinear(64, [40, 40]), False),
        # rank 1 of 2 of a row-parallel layer with a bias: rank 0 adds it, this rank's call gets None
        ("row tp rank 1/2", lambda: RowParallelLinear(96, 32, bias=True, tp=ParallelContext(1, 2)), False),
    ]
    cases = []
    for index, (label, build, with_bias) in enumerate(layouts):
        make_layer = _layer_builder(build, fill, dtype, device, 100 + index)
        sample: Any = make_layer()
        features = int(sample.weight.shape[1])
        bias = sample.bias.detach().clone() if with_bias else None
        for rows in ROWS:
            x = _randn(_generator(200 + index, rows), rows, features, dtype=dtype, device=device)
            cases.append(OpCase("linear", f"{label}, {rows}x{features}", make_layer, (x, bias),
                                **_tol(_GEMM_TOL, dtype)))
    return cases


def _embedding_fill(layer: Any, gen: torch.Generator) -> None:
    _load(layer.weight, torch.randn(layer.num_embeddings, layer.embedding_dim, generator=gen))


def embedding_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    from sparrow.layers.embedding import VocabParallelEmbedding

    layouts = [
        ("vocab 50", lambda: VocabParallelEmbedding(50, 16), 50),
        # rank 1 of 2 over 51 ids: rows 26..50, one zero padding row; other ids give zero rows
        ("padded vocab 51, tp rank 1/2", lambda: VocabParallelEmbedding(51, 16, tp=ParallelContext(1, 2)), 51),
    ]
    cases = []
    for index, (label, build, vocab) in enumerate(layouts):
        make_layer = _layer_builder(build, _embedding_fill, dtype, device, 300 + index)
        for rows in ROWS:
            ids = torch.randint(0, vocab, (rows,), generator=_generator(400 + index, rows))
            ids[0] = vocab - 1  # the last real id, next to the padding
            cases.append(OpCase("embedding", f"{label}, {rows} ids", make_layer, (ids.to(device),), exact=True))
    return cases


def lm_head_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    from sparrow.layers.embedding import ParallelLMHead

    def fill(layer: Any, gen: torch.Generator) -> None:
        _load(layer.weight, torch.randn(layer.num_embeddings, layer.embedding_dim, generator=gen) / 32 ** 0.5)

    layouts = [
        ("vocab 50", lambda: ParallelLMHead(50, 32)),
        # this rank's 26 columns, the last one a padding row's zero logits
        ("padded vocab 51, tp rank 1/2", lambda: ParallelLMHead(51, 32, tp=ParallelContext(1, 2))),
    ]
    cases = []
    for index, (label, build) in enumerate(layouts):
        make_layer = _layer_builder(build, fill, dtype, device, 500 + index)
        for rows in ROWS:
            hidden = _randn(_generator(600 + index, rows), rows, 32, dtype=dtype, device=device)
            cases.append(OpCase("lm_head", f"{label}, {rows}x32", make_layer, (hidden,), **_tol(_GEMM_TOL, dtype)))
    return cases


def rms_norm_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    from sparrow.layers.layernorm import RMSNorm

    def fill(layer: Any, gen: torch.Generator) -> None:
        _load_replicated(layer.weight, torch.randn(layer.hidden_size, generator=gen) * 0.2 + 1.0)

    tol = _tol(_ELEMENTWISE_TOL, dtype)
    norm64 = _layer_builder(lambda: RMSNorm(64, eps=1e-5), fill, dtype, device, 700)
    head_norm = _layer_builder(lambda: RMSNorm(16, eps=1e-6), fill, dtype, device, 701)
    cases = []
    for rows in ROWS:
        gen = _generator(800, rows)
        x = _randn(gen, rows, 64, dtype=dtype, device=device, scale=3.0)
        residual = _randn(gen, rows, 64, dtype=dtype, device=device)
        cases.append(OpCase("rms_norm", f"{rows}x64", norm64, (x,), **tol))
        cases.append(OpCase("rms_norm", f"residual, {rows}x64", norm64, (x, residual), **tol))
        # q/k norm: per head over [tokens, heads, head_dim]
        heads = _randn(gen, rows, 4, 16, dtype=dtype, device=device)
        cases.append(OpCase("rms_norm", f"3D heads, {rows}x4x16", head_norm, (heads,), **tol))
    return cases


def _load_replicated(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, full)
    else:
        param.data.copy_(full)


def rotary_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    from sparrow.layers.rotary import RotaryEmbedding, default_inv_freq

    def nothing(layer: Any, gen: torch.Generator) -> None:
        pass  # the cos/sin cache is computed, not loaded

    layouts = [
        ("full", 32, 32),
        ("partial rotary 16/32", 32, 16),
    ]
    tol = _tol(_ELEMENTWISE_TOL, dtype)
    cases = []
    for index, (label, head_dim, rotary_dim) in enumerate(layouts):
        build = functools.partial(RotaryEmbedding, head_dim, rotary_dim, default_inv_freq(rotary_dim, 10000.0),
                                  max_position=256)
        make_layer = _layer_builder(build, nothing, dtype, device, 900 + index)
        for rows in ROWS:
            gen = _generator(1000 + index, rows)
            positions = torch.randint(0, 256, (rows,), generator=gen)
            positions[-1] = 255  # the cache's last row
            query = _randn(gen, rows, 4, head_dim, dtype=dtype, device=device)
            key = _randn(gen, rows, 2, head_dim, dtype=dtype, device=device)
            cases.append(OpCase("rotary_embedding", f"{label}, {rows} tokens x 4q/2kv heads", make_layer,
                                (positions.to(device), query, key), **tol))
    return cases


def silu_and_mul_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    from sparrow.layers.activation import SiluAndMul

    tol = _tol(_ELEMENTWISE_TOL, dtype)
    cases = []
    for rows in ROWS:
        x = _randn(_generator(1100, rows), rows, 2 * 48, dtype=dtype, device=device, scale=4.0)
        cases.append(OpCase("silu_and_mul", f"{rows}x96", SiluAndMul, (x,), **tol))
    x3 = _randn(_generator(1101), 2, 3, 2 * 24, dtype=dtype, device=device)
    cases.append(OpCase("silu_and_mul", "3D 2x3x48", SiluAndMul, (x3,), **tol))
    return cases


# -- function ops (the sampler's steps; the sampler works in float32 whatever the model dtype) --

def top_k_top_p_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    cases = []
    vocab = 100
    for rows in ROWS:
        gen = _generator(1200, rows)
        logits = _randn(gen, rows, vocab, dtype=torch.float32, device=device, scale=3.0)
        top_k = torch.randint(1, 40, (rows,), generator=gen)
        top_p = torch.rand(rows, generator=gen) * 0.8 + 0.1
        # Some rows unrestricted: k = 0 and p = 1 mean off.
        top_k[::3] = 0
        top_p[1::3] = 1.0
        top_k, top_p = top_k.to(device), top_p.to(device)
        cases.append(OpCase("top_k_top_p", f"top-k, {rows}x{vocab}", None, (logits, top_k, None), exact=True))
        cases.append(OpCase("top_k_top_p", f"top-p, {rows}x{vocab}", None, (logits, None, top_p), exact=True))
        cases.append(OpCase("top_k_top_p", f"top-k and top-p, {rows}x{vocab}", None, (logits, top_k, top_p),
                            exact=True))
    return cases


def draw_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    from sparrow.sample.metadata import sum_dtype

    cases = []
    # 100 columns: scanned whole; 2048: in chunks
    for rows, vocab in ((1, 100), (5, 2048), (37, 100), (37, 2048)):
        gen = _generator(1300, rows, vocab)
        probs = (torch.randn(rows, vocab, generator=gen) * 2).softmax(dim=-1)
        probs[:, 1::4] = 0.0  # tokens a filter removed must never be drawn
        probs = (probs / probs.sum(dim=-1, keepdim=True)).to(device)
        for label, seeded in (("no seeded rows", []), ("some rows seeded", list(range(0, rows, 2))),
                              ("all rows seeded", list(range(rows)))):
            seeded_rows = torch.tensor(seeded, dtype=torch.int64, device=device) if seeded else None
            uniforms = (torch.rand(len(seeded), generator=gen, dtype=torch.float64).to(device, sum_dtype(device))
                        if seeded else None)
            noise = torch.Generator(device=device).manual_seed(rows * 7 + vocab)
            cases.append(OpCase("draw", f"{label}, {rows}x{vocab}", None, (probs, noise, seeded_rows, uniforms),
                                compare=_compare_draws))
    return cases


def _compare_draws(expected: torch.Tensor, got: torch.Tensor, args: tuple) -> tuple[bool, str]:
    """Seeded rows must draw the reference's token (it is a function of the row and its uniform
    alone); every row must draw a token of non-zero probability. Unseeded rows may differ: a
    platform may draw its noise another way."""
    probs, _noise, seeded_rows, _uniforms = args
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return False, f"expected {tuple(expected.shape)} {expected.dtype} token ids, got {describe_value(got)}"
    got_cpu, probs_cpu = got.cpu(), probs.cpu()
    if bool(((got_cpu < 0) | (got_cpu >= probs_cpu.shape[1])).any()):
        return False, "a token id outside the vocabulary"
    chosen = probs_cpu.gather(1, got_cpu.unsqueeze(1)).squeeze(1)
    if bool((chosen <= 0).any()):
        return False, f"drew a zero-probability token in row {int((chosen <= 0).nonzero()[0])}"
    if seeded_rows is not None:
        rows = seeded_rows.cpu()
        mismatched = (got_cpu[rows] != expected.cpu()[rows]).nonzero()
        if mismatched.numel():
            row = int(rows[int(mismatched[0])])
            return False, f"seeded row {row} drew {int(got_cpu[row])}, the reference {int(expected.cpu()[row])}"
    return True, f"{got.shape[0]} rows, seeded rows equal"


def sample_from_logits_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    from sparrow.sample.metadata import sum_dtype

    cases = []
    # 100 columns: the reference scans them whole, a kernel in one block; 2048: chunked; 5000:
    # more than one block of a kernel that holds 4096 tokens at a time. Logits in the case's dtype.
    for rows, vocab in ((1, 100), (5, 2048), (37, 100), (37, 5000)):
        gen = _generator(1400, rows, vocab)
        logits = torch.randn(rows, vocab, generator=gen) * 4
        logits[:, 1::4] = float("-inf")  # a grammar mask or a logit bias: never drawn
        if rows > 1:
            logits[1] = float("-inf")
            logits[1, vocab // 2] = 0.5  # one token allowed: the row's only choice
        temperature = torch.rand(rows, generator=gen) * 0.7 + 0.3
        uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
        uniforms[0] = 0.0  # the first token with mass
        if rows > 2:
            uniforms[2] = 1 - 2**-24  # the end (within rounding): the last token with mass
        cases.append(OpCase("sample_from_logits", f"{rows}x{vocab}", None,
                            (logits.to(device, dtype), temperature.to(device), uniforms.to(device, sum_dtype(device))),
                            compare=_compare_samples))
    return cases


# How close (relative) a uniform may come to a token boundary of the exact cumulative distribution
# and still have one right answer: the reference's float32 softmax and chunk sums, and a kernel's
# float32 weights and partial sums, each move a boundary C by up to a few 1e-5 * C (see inverse_cdf).
_BOUNDARY_TOL = 1e-4


def _compare_samples(expected: torch.Tensor, got: torch.Tensor, args: tuple) -> tuple[bool, str]:
    """Every row must draw a token of non-zero probability (a finite logit), and the reference's
    token wherever its uniform lies farther than ``_BOUNDARY_TOL`` (relative) from every boundary of
    the float64 cumulative distribution of ``softmax(logits / T)``. Closer than that, either
    neighbour is right: equality there would test rounding, not sampling. The cases keep most rows
    away from boundaries (at least half, or the case itself is refused)."""
    logits, temperature, uniforms = args
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return False, f"expected {tuple(expected.shape)} {expected.dtype} token ids, got {describe_value(got)}"
    got_cpu, expected_cpu = got.cpu(), expected.cpu()
    scaled = logits.cpu().double() / temperature.cpu().double().unsqueeze(1)
    if bool(((got_cpu < 0) | (got_cpu >= scaled.shape[1])).any()):
        return False, "a token id outside the vocabulary"
    chosen = scaled.gather(1, got_cpu.unsqueeze(1)).squeeze(1)
    if bool((chosen == float("-inf")).any()):
        return False, f"drew a zero-probability token in row {int((chosen == float('-inf')).nonzero()[0])}"
    cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
    u = uniforms.cpu().double().unsqueeze(1)
    keep = ~((cdf - u).abs() < _BOUNDARY_TOL * cdf).any(dim=-1)
    kept = int(keep.sum())
    if 2 * kept < got.shape[0]:
        return False, f"only {kept} of {got.shape[0]} rows lie away from a token boundary: the case compares too little"
    mismatched = ((got_cpu != expected_cpu) & keep).nonzero()
    if mismatched.numel():
        row = int(mismatched[0])
        return False, (f"row {row} (uniform {float(u[row]):.6g}, away from boundaries) drew {int(got_cpu[row])}, "
                       f"the reference {int(expected_cpu[row])}")
    return True, f"{got.shape[0]} rows: {kept} away from a token boundary equal, all of non-zero probability"


def describe_value(value: Any) -> str:
    """Shape and dtype of a tensor, else the type's name (for failure details)."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return type(value).__name__
