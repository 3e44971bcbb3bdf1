"""The CUDA platform's fused sampling kernel (sparrow_cuda.triton_sampling) against the
``sample_from_logits`` op's torch reference (temperature, softmax, inverse_cdf), its registration
for platform "cuda", and the sampler's use of it.

As in test_triton_lora.py: on a machine without CUDA where nothing imported triton yet, this module
sets TRITON_INTERPRET=1 and runs the kernel in-process on CPU tensors; otherwise one test re-runs
this file in a subprocess with the variable set, and the ``cuda``-marked tests run the same checks
with the compiled kernel on the GPU. Sizes are small (the interpreter is slow): up to 8 rows, up to
3000 tokens in blocks of 16 to 512 (several blocks, the last one partial).

Kernel and reference round differently (float32 weights and partial sums on both sides), so a
token is compared exactly only where its row's uniform lies farther than 1e-4 (relative) from every
boundary of the float64 cumulative distribution; nearer, either neighbour is right. Most rows are
that far, and the tests assert it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = HAS_TRITON and (os.environ.get("TRITON_INTERPRET") == "1" or (
    "triton" not in sys.modules and not torch.cuda.is_available()))
if INTERPRETING:
    os.environ["TRITON_INTERPRET"] = "1"

from sparrow.sample.metadata import build_sampling_metadata  # noqa: E402
from sparrow.sample.sampler import Sampler, draw_uniforms  # noqa: E402
from sparrow.sample.sampler import sample_from_logits as reference  # noqa: E402
from sparrow.sampling_params import SamplingParams  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess")
compiled = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(),
                              reason="needs an NVIDIA GPU (and triton not interpreting)")
IMPL = "sparrow_cuda.triton_sampling:sample_from_logits"
BOUNDARY_TOL = 1e-4


@pytest.mark.skipif(INTERPRETING or not HAS_TRITON, reason="already running under the interpreter")
def test_interpreted_kernels_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600)
    if result.returncode in (0, 5) and " passed" not in result.stdout:  # 5: all skipped
        pytest.skip("interpreter run skipped: " + result.stdout.strip()[-300:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_registered_for_cuda_as_a_function_op():
    from sparrow.ops import KERNEL_OPS
    from sparrow.plugins import get_registry
    from sparrow_cuda.ops import sparrow_register_ops

    assert KERNEL_OPS["sample_from_logits"].kind == "function"
    calls = []
    sparrow_register_ops(register=lambda op, platform, impl, override=False: calls.append((op, platform, impl)))
    assert ("sample_from_logits", "cuda", IMPL) in calls
    entry = get_registry().ops["sample_from_logits"]
    assert entry["cuda"] == IMPL and "cpu" not in entry


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_cuda_sampler_resolves_the_kernel_and_the_cpu_sampler_keeps_its_steps():
    from sparrow.ops import resolve_function_op
    from sparrow_cuda.triton_sampling import sample_from_logits

    assert resolve_function_op("sample_from_logits", "cuda") is sample_from_logits
    assert resolve_function_op("sample_from_logits", "cpu") is reference
    assert Sampler(platform="cuda").sample_from_logits is sample_from_logits
    # No platform implementation: the rows go through temperature, softmax and draw, as before.
    assert Sampler(platform="cpu").sample_from_logits is None and Sampler().sample_from_logits is None


# -- the checks, run on CPU tensors by the interpreter and on CUDA tensors by the GPU ----------

def kernel(*args, **kwargs):
    from sparrow_cuda.triton_sampling import sample_from_logits

    return sample_from_logits(*args, **kwargs)


def llm_like_logits(rows: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    """A long tail of small logits and a few large ones per row, as a language model's."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    for row in range(rows):
        top = torch.randperm(vocab, generator=gen)[:6]
        logits[row, top] += torch.rand(6, generator=gen) * 6 + 6
    return logits.to(device)


def near_boundary(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose uniform lies within BOUNDARY_TOL (relative) of a token boundary of the
    float64 cumulative distribution of softmax(logits / T)."""
    scaled = logits.double() / temperature.double().unsqueeze(1)
    cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
    u = uniforms.double().unsqueeze(1)
    return ((cdf - u).abs() < BOUNDARY_TOL * cdf).any(dim=-1).cpu()


def check_against_reference(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                            min_kept: float = 0.6, **kwargs) -> torch.Tensor:
    """The kernel's tokens: the reference's on every row away from a boundary (at least
    ``min_kept`` of them), and of non-zero probability on every row."""
    expected = reference(logits, temperature, uniforms).cpu()
    got = kernel(logits, temperature, uniforms, **kwargs)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],) and got.device == logits.device
    got = got.cpu()
    assert bool(((got >= 0) & (got < logits.shape[1])).all())
    chosen = logits.cpu().float().gather(1, got.unsqueeze(1)).squeeze(1)
    assert bool(torch.isfinite(chosen).all()), f"a -inf token was drawn: {got.tolist()}"
    keep = ~near_boundary(logits, temperature, uniforms)
    assert float(keep.float().mean()) >= min_kept, f"only {int(keep.sum())} of {keep.numel()} rows compared"
    mismatched = ((got != expected) & keep).nonzero().flatten().tolist()
    assert not mismatched, [(row, int(got[row]), int(expected[row]), float(uniforms[row])) for row in mismatched]
    return got


def check_matches_reference(device: str, configs) -> None:
    """(a): several vocabularies and blocks (the last block partial), temperatures and uniform
    dtypes, four sets of uniforms each."""
    kept = total = 0
    for index, (rows, vocab, block, uniform_dtype) in enumerate(configs):
        logits = llm_like_logits(rows, vocab, seed=index, device=device)
        gen = torch.Generator().manual_seed(100 + index)
        temperature = torch.full((rows,), 0.6)
        temperature[1::2] = torch.rand(rows // 2, generator=gen) * 1.2 + 0.3
        temperature = temperature.to(device)
        for _ in range(4):
            uniforms = torch.rand(rows, generator=gen, dtype=torch.float64).to(device, uniform_dtype)
            check_against_reference(logits, temperature, uniforms, min_kept=0.0, block_size=block)
            keep = ~near_boundary(logits, temperature, uniforms)
            kept, total = kept + int(keep.sum()), total + rows
    assert kept >= 0.8 * total, f"only {kept} of {total} rows away from a boundary"


def check_never_draws_minus_inf(device: str, block: int) -> None:
    """(b): -inf tokens (a grammar mask, a logit bias) are never drawn: masked columns, whole
    masked blocks, a row with one finite token, and uniforms at the very end of [0, 1)."""
    vocab = 5 * block + 7
    logits = llm_like_logits(8, vocab, seed=7, device="cpu")
    logits[:, 1::3] = float("-inf")
    logits[1, : 2 * block + 3] = float("-inf")  # two whole blocks and a bit more masked
    logits[2] = float("-inf")
    logits[2, 3 * block + 1] = -5.0  # the only finite token, in the middle of a block
    logits[3] = float("-inf")
    logits[3, vocab - 1] = 2.0  # the only finite token, the last column (a partial block)
    logits[4, vocab - 2 * block:] = float("-inf")  # the tail masked: the end is not the last column
    logits[5, 0] = 9.0  # no mask at the very start, but every third column masked
    last_finite = [max(i for i in range(vocab) if math.isfinite(logits[row, i])) for row in range(8)]
    logits = logits.to(device)
    temperature = torch.full((8,), 0.6, device=device)
    gen = torch.Generator().manual_seed(3)
    ends = {torch.float64: 1 - 2**-53, torch.float32: 1 - 2**-24}
    for uniform_dtype, end in ends.items():
        for fill in (0.0, 0.5, end, 1.0):  # 1.0 is outside [0, 1): where rounding can put a target
            uniforms = torch.rand(8, generator=gen, dtype=torch.float64)
            uniforms[4:] = fill
            uniforms = uniforms.to(device, uniform_dtype)
            got = check_against_reference(logits, temperature, uniforms, min_kept=0.0, block_size=block).tolist()
            assert got[2] == 3 * block + 1 and got[3] == vocab - 1, got
            if fill == 1.0 or (fill == end and uniform_dtype == torch.float64):
                # The target at (or within 2**-53 of) the end: the last token with mass. (1 - 2**-24
                # may still fall before a tail token of share < 2**-24: its check is the one above.)
                assert got[4:] == last_finite[4:], (fill, got, last_finite)


def check_dtypes_and_strides(device: str, block: int) -> None:
    """(c): bfloat16 and float16 logits, a column slice of a wider tensor (row stride > vocab), a
    transposed view (column stride > 1) and rows that share storage (row stride 0)."""
    vocab = 3 * block + 11
    base = llm_like_logits(6, vocab, seed=11, device=device)
    temperature = torch.tensor([0.6, 0.6, 1.0, 0.3, 0.6, 1.4], device=device)
    gen = torch.Generator().manual_seed(5)
    uniforms = torch.rand(6, generator=gen, dtype=torch.float64).to(device)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits = base.to(dtype)
        check_against_reference(logits, temperature, uniforms, min_kept=0.5, block_size=block)
        wide = torch.full((6, vocab + 40), 50.0, device=device, dtype=dtype)  # 50: would win if read
        wide[:, 13:13 + vocab] = logits
        sliced = wide[:, 13:13 + vocab]
        assert sliced.stride(0) == vocab + 40
        got = check_against_reference(sliced, temperature, uniforms, min_kept=0.5, block_size=block)
        assert torch.equal(got, kernel(logits, temperature, uniforms, block_size=block).cpu())
        transposed = logits.t().contiguous().t()
        assert transposed.stride() == (1, 6)
        assert torch.equal(kernel(transposed, temperature, uniforms, block_size=block).cpu(), got)
    shared = base[:1].expand(6, -1)  # one row read six times
    got = kernel(shared, temperature.new_full((6,), 0.6), uniforms, block_size=block).cpu()
    alone = [int(kernel(base[:1], temperature.new_full((1,), 0.6), uniforms[r:r + 1], block_size=block))
             for r in range(6)]
    assert got.tolist() == alone


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The upper 0.1% point (z = 3.09) of the chi-square distribution with ``dof`` degrees of
    freedom, by the Wilson-Hilferty approximation (within ~1% for dof >= 3)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, bins with fewer than ``min_expected``
    expected draws merged into one; a draw of a zero-probability token makes it infinite."""
    counts, probs = counts.double(), probs.double()
    if float(counts[probs == 0].sum()) > 0:
        return math.inf, 0
    expected = probs * counts.sum()
    small = expected < min_expected
    observed = torch.cat([counts[~small], counts[small].sum().unsqueeze(0)])
    wanted = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    return float(((observed - wanted) ** 2 / wanted).sum()), observed.numel() - 1


def check_distribution(device: str, rows: int) -> None:
    """(d): ``rows`` rows of the same logits (three blocks, some tokens masked) with fresh
    uniforms: the counts fit softmax(l / T) (chi-square, 0.1% level, fixed seeds), and the same
    counts are rejected as draws at temperature 1 (the test can tell a kernel that ignores T)."""
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(40, generator=gen) * 1.5
    logits[[3, 17, 38]] = float("-inf")
    temperature = 0.6
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64).to(device)
    sampled = kernel(logits.to(device).expand(rows, -1), torch.full((rows,), temperature, device=device), uniforms,
                     block_size=16).cpu()
    counts = torch.bincount(sampled, minlength=40)
    statistic, dof = chi_square(counts, (logits.double() / temperature).softmax(dim=-1))
    assert statistic < chi_square_critical(dof), (statistic, dof, counts.tolist())
    wrong, wrong_dof = chi_square(counts, logits.double().softmax(dim=-1))
    assert wrong > chi_square_critical(wrong_dof), (wrong, wrong_dof)


class CountingOp:
    """The kernel (several blocks), counting its calls."""

    def __init__(self, block: int) -> None:
        self.calls = 0
        self.op = functools.partial(kernel, block_size=block)

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


def check_sampler_uses_the_op(device: str) -> None:
    """(e): through the sampler: a seeded row draws the same token whatever else the batch holds
    (and wherever it sits); the op serves temperature-only batches at the uniforms ``draw`` would
    use (the tokens of the step-by-step sampler, away from boundaries), and leaves batches that
    filter or are all greedy to the other paths."""
    vocab = 700
    target = SamplingParams(temperature=0.6, seed=42)
    neighbours = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=1.2, seed=7), SamplingParams(temperature=0.6, seed=43)]
    op = CountingOp(block=128)
    noise = torch.Generator().manual_seed(9)
    alone_tokens, crowded_tokens = [], []
    for step in range(5):
        row_logits = llm_like_logits(1, vocab, seed=50 + step, device=device)
        outputs = [list(range(step))]
        alone = Sampler(torch.Generator(device=device).manual_seed(0), sample_from_logits_op=op)(
            row_logits, build_sampling_metadata([target], outputs, [[]], vocab, device)).sampled_token_ids
        others = llm_like_logits(4, vocab, seed=60 + step, device=device)
        others = others + torch.randn(4, vocab, generator=noise).to(device)
        logits = torch.cat([others[:2], row_logits, others[2:]])
        params = neighbours[:2] + [target] + neighbours[2:]
        crowded = Sampler(torch.Generator(device=device).manual_seed(step + 1), sample_from_logits_op=op)(
            logits, build_sampling_metadata(params, [[1] * 3, [], list(range(step)), [2], [5, 5]], [[]] * 5,
                                            vocab, device)).sampled_token_ids
        alone_tokens.append(int(alone[0]))
        crowded_tokens.append(int(crowded[2]))
        assert int(crowded[1]) == int(logits[1].argmax()), "the greedy row takes its argmax"
    assert op.calls == 10
    assert crowded_tokens == alone_tokens and len(set(alone_tokens)) > 1

    # The uniforms are draw's: the same generator state gives the step-by-step sampler's tokens.
    rows = 8
    logits = llm_like_logits(rows, vocab, seed=70, device=device)
    params = [SamplingParams(temperature=0.6, seed=row if row % 3 == 0 else None) for row in range(rows)]
    metadata = build_sampling_metadata(params, [[0] * row for row in range(rows)], [[]] * rows, vocab, device)
    fused = Sampler(torch.Generator(device=device).manual_seed(4), sample_from_logits_op=op)(logits, metadata)
    stepwise = Sampler(torch.Generator(device=device).manual_seed(4))(logits, metadata)
    uniforms = draw_uniforms(rows, logits.device, torch.Generator(device=device).manual_seed(4),
                             metadata.seeded_rows, metadata.seeded_uniforms)
    keep = ~near_boundary(logits, metadata.temperature, uniforms)
    assert int(keep.sum()) >= rows // 2
    got, want = fused.sampled_token_ids.cpu(), stepwise.sampled_token_ids.cpu()
    assert torch.equal(got[keep], want[keep]), (got.tolist(), want.tolist(), keep.tolist())
    assert op.calls == 11

    calls = op.calls
    for filtered in (SamplingParams(temperature=0.6, top_k=20), SamplingParams(temperature=0.6, top_p=0.9),
                     SamplingParams(temperature=0.6, min_p=0.1), SamplingParams(temperature=0.0)):
        metadata = build_sampling_metadata([filtered] * 2, [[], []], [[]] * 2, vocab, device)
        Sampler(torch.Generator(device=device).manual_seed(0), sample_from_logits_op=op)(logits[:2], metadata)
    assert op.calls == calls, "filters and all-greedy batches do not use the op"


@interpreted
def test_matches_the_reference_away_from_token_boundaries():
    check_matches_reference("cpu", [(8, 3000, 512, torch.float64), (8, 1000, 256, torch.float32),
                                    (5, 2048, None, torch.float64), (3, 70, 16, torch.float64)])


@interpreted
def test_never_draws_a_minus_inf_token():
    check_never_draws_minus_inf("cpu", block=64)


@interpreted
def test_half_precision_and_strided_logits():
    check_dtypes_and_strides("cpu", block=128)


@interpreted
def test_draws_follow_the_tempered_softmax():
    check_distribution("cpu", rows=300)


@interpreted
def test_the_sampler_uses_it_and_seeded_rows_ignore_the_batch():
    check_sampler_uses_the_op("cpu")


@interpreted
def test_conformance_cases():
    from sparrow.ops.check import op_cases, run_case

    for dtype in (torch.float32, torch.bfloat16):
        for case in op_cases("sample_from_logits", dtype, torch.device("cpu")):
            ok, detail = run_case(case, kernel)
            assert ok, f"{case.label}: {detail}"


@interpreted
def test_refuses_shapes_it_cannot_read():
    logits = torch.zeros(3, 20)
    temperature, uniforms = torch.ones(3), torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="temperature"):
        kernel(logits, temperature[:2], uniforms)
    with pytest.raises(ValueError, match="uniforms"):
        kernel(logits, temperature, uniforms[:1])
    with pytest.raises(ValueError, match="batch, vocab"):
        kernel(logits[0], temperature, uniforms)
    with pytest.raises(ValueError, match="block_size"):
        kernel(logits, temperature, uniforms, block_size=24)
    assert kernel(logits[:0], temperature[:0], uniforms[:0]).shape == (0,)


# -- the same checks with the compiled kernel ----------------------------------------------------

@pytest.mark.cuda
@compiled
def test_gpu_matches_the_reference_and_never_draws_minus_inf():
    from sparrow.ops.check import op_cases, run_case

    check_matches_reference("cuda", [(8, 3000, 512, torch.float64), (8, 1000, 256, torch.float32),
                                     (5, 2048, None, torch.float64), (3, 70, 16, torch.float64),
                                     (64, 151936, None, torch.float64)])
    for block in (64, 4096):
        check_never_draws_minus_inf("cuda", block)
        check_dtypes_and_strides("cuda", block)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for case in op_cases("sample_from_logits", dtype, torch.device("cuda")):
            ok, detail = run_case(case, kernel)
            assert ok, f"{case.label}: {detail}"


@pytest.mark.cuda
@compiled
def test_gpu_benchmark_shape_distribution_and_sampler():
    # The benchmark's step: 256 rows of a 151936-token vocabulary at temperature 0.6, bf16 and float32.
    logits = llm_like_logits(256, 151936, seed=1, device="cuda")
    temperature = torch.full((256,), 0.6, device="cuda")
    uniforms = torch.rand(256, generator=torch.Generator().manual_seed(2), dtype=torch.float64).cuda()
    for dtype in (torch.float32, torch.bfloat16):
        check_against_reference(logits.to(dtype), temperature, uniforms, min_kept=0.8)
    check_distribution("cuda", rows=200_000)
    check_sampler_uses_the_op("cuda")
    # CPU tensors with compiled Triton: the reference serves them.
    cpu_args = (logits[:4].cpu(), temperature[:4].cpu(), uniforms[:4].cpu())
    assert torch.equal(kernel(*cpu_args), reference(*cpu_args))
