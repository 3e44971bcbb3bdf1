"""The CUDA platform's Triton segment GEMMs for add_lora (sparrow_cuda.triton_lora) against the op's
torch reference (sparrow.lora.ops.add_lora), and its registration for platform "cuda".

As in test_triton_moe.py: on a machine without CUDA where nothing imported triton yet, this module
sets TRITON_INTERPRET=1 and runs the kernels in-process on CPU tensors; otherwise one test re-runs
this file in a subprocess with the variable set, and the ``cuda``-marked tests run the same checks
with the compiled kernels on the GPU. Sizes are small (the interpreter is slow) but ragged: 1, 5
and 37 tokens, ranks 8, 16 and 72, widths that are no multiple of a tile, unsorted slot ids.
"""

from __future__ import annotations

import importlib.util
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

from sparrow.lora.ops import add_lora  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess")
compiled = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(),
                              reason="needs an NVIDIA GPU (and triton not interpreting)")
IMPL = "sparrow_cuda.triton_lora:triton_add_lora"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


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
    from sparrow.plugins import get_registry
    from sparrow_cuda.ops import sparrow_register_ops

    calls = []
    sparrow_register_ops(register=lambda op, platform, impl, override=False: calls.append((op, platform, impl)))
    assert ("add_lora", "cuda", IMPL) in calls
    entry = get_registry().ops["add_lora"]
    assert entry["cuda"] == IMPL and not str(entry.get("cpu", "")).startswith("sparrow_cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_resolves_to_the_triton_function_on_cuda():
    from sparrow.ops import resolve_function_op
    from sparrow_cuda.triton_lora import triton_add_lora

    assert resolve_function_op("add_lora", "cuda") is triton_add_lora


# -- the checks, run on CPU tensors by the interpreter and on CUDA tensors by the GPU ----------

def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 5e-3, "rtol": 5e-3},
            torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}[dtype]


def lora_inputs(tokens: int, slots: list[int], num_slots: int, rank: int, d_in: int, d_out: int,
                dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 1000 + tokens * 31 + rank)
    x = torch.randn(tokens, d_in, generator=gen)
    y = torch.randn(tokens, d_out, generator=gen)
    a = torch.randn(num_slots, rank, d_in, generator=gen) * 0.2
    b = torch.randn(num_slots, d_out, rank, generator=gen) * 0.2
    scalings = torch.rand(num_slots, generator=gen) * 2.0
    token_slots = torch.tensor([slots[i % len(slots)] for i in range(tokens)], dtype=torch.int64)
    return (y.to(device, dtype), x.to(device, dtype), a.to(device, dtype), b.to(device, dtype),
            token_slots.to(device), scalings.to(device))


def check_against_reference(args, dtype: torch.dtype, **kwargs) -> None:
    from sparrow_cuda.triton_lora import triton_add_lora

    y = args[0]
    expected = add_lora(y.clone(), *args[1:])
    got = triton_add_lora(*args, **kwargs)
    assert got.data_ptr() == y.data_ptr(), "the update is written into y"
    assert got.shape == expected.shape and got.dtype == dtype and got.device == y.device
    torch.testing.assert_close(got, expected, **tolerance(dtype))


def check_conformance(device: str, dtype: torch.dtype) -> None:
    from sparrow.ops.check import op_cases, run_case
    from sparrow_cuda.triton_lora import triton_add_lora

    cases = op_cases("add_lora", dtype, torch.device(device))
    assert cases
    for case in cases:
        ok, detail = run_case(case, triton_add_lora)
        assert ok, f"{case.label}: {detail}"


def check_base_tokens_untouched(device: str) -> None:
    y, x, a, b, slots, scalings = lora_inputs(7, [-1, 1, -1, 0, 5, -1, 1], 2, 8, 24, 20, torch.float32, device)
    before = y.clone()
    got = add_lora_kernel(y, x, a, b, slots, scalings)
    base = (slots < 0) | (slots >= 2)  # an id past the last slot is served as base too
    assert torch.equal(got[base], before[base])
    assert not torch.equal(got[~base], before[~base])


def check_strided_views(device: str) -> None:
    """y a column slice of a fused output, x a column slice of a wider input, the adapter stacks
    transposed views: the kernels honour every stride and write only y's columns."""
    fused = torch.randn(9, 70, device=device)
    y = fused[:, 10:50]
    wide = torch.randn(9, 80, device=device)
    x = wide[:, 5:53]
    a = torch.randn(3, 48, 8, device=device).transpose(1, 2) * 0.2  # [3, 8, 48], not contiguous
    b = torch.randn(3, 8, 40, device=device).transpose(1, 2) * 0.2  # [3, 40, 8]
    slots = torch.tensor([2, 0, -1, 2, 1, 0, 0, -1, 2], device=device)
    scalings = torch.tensor([1.0, 0.5, 2.0], device=device)
    expected = add_lora(y.clone(), x, a, b, slots, scalings)
    outside = torch.cat([fused[:, :10], fused[:, 50:]], dim=1).clone()
    add_lora_kernel(y, x, a, b, slots, scalings)
    torch.testing.assert_close(fused[:, 10:50], expected, **tolerance(torch.float32))
    assert torch.equal(torch.cat([fused[:, :10], fused[:, 50:]], dim=1), outside)


def add_lora_kernel(*args, **kwargs):
    from sparrow_cuda.triton_lora import triton_add_lora

    return triton_add_lora(*args, **kwargs)


RAGGED = [  # (tokens, slot pattern, rank, d_in, d_out)
    (1, [2], 8, 48, 40),
    (5, [3, 0, 3, -1, 1], 16, 40, 72),
    (37, [1, -1, 3, 3, 0, 1, 2, 0, -1, 2, 3], 8, 64, 100),
    (37, [2, 0, -1], 16, 24, 40),
    (5, [-1], 16, 48, 40),  # every token base: y comes back untouched
]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_conformance_cases(dtype):
    check_conformance("cpu", dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,slots,rank,d_in,d_out", RAGGED)
def test_ragged_batches(tokens, slots, rank, d_in, d_out, dtype):
    check_against_reference(lora_inputs(tokens, slots, 4, rank, d_in, d_out, dtype, "cpu"), dtype)


@interpreted
def test_all_base_tokens_leave_y_bit_identical():
    y, x, a, b, slots, scalings = lora_inputs(5, [-1], 4, 8, 48, 40, torch.bfloat16, "cpu")
    before = y.clone()
    assert torch.equal(add_lora_kernel(y, x, a, b, slots, scalings), before)


@interpreted
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_split_k_sums_partial_products(split_k):
    # in = 100 is no multiple of the K tile; rank 72 takes two rank tiles in both phases.
    check_against_reference(lora_inputs(6, [1, 0, -1, 1, 2, 0], 3, 72, 100, 36, torch.float32, "cpu"),
                            torch.float32, split_k=split_k)


@interpreted
def test_strided_views_and_base_tokens():
    check_strided_views("cpu")
    check_base_tokens_untouched("cpu")


@interpreted
def test_group_by_slot():
    from sparrow_cuda.triton_lora import group_by_slot

    slots = torch.tensor([2, -1, 0, 2, 7, 0, 2, -1])
    order, counts, starts = group_by_slot(slots, num_slots=4)
    assert counts.tolist() == [2, 0, 3, 0] and starts.tolist() == [0, 2, 2, 5]
    assert order.dtype == torch.int32 and order.shape == (8,)
    assert order[:5].tolist() == [2, 5, 0, 3, 6], "grouped by slot, in token order within a slot"
    assert sorted(order[5:].tolist()) == [1, 4, 7], "base (and out-of-range) tokens come last"


@interpreted
def test_mixed_dtypes_fall_back_to_the_reference():
    y, x, a, b, slots, scalings = lora_inputs(5, [0, 1, -1], 2, 8, 24, 20, torch.float32, "cpu")
    expected = add_lora(y.clone(), x, a, b, slots, scalings)
    got = add_lora_kernel(y.clone(), x, a.bfloat16(), b.bfloat16(), slots, scalings)
    assert torch.equal(got, add_lora(y.clone(), x, a.bfloat16(), b.bfloat16(), slots, scalings))
    torch.testing.assert_close(got, expected, **tolerance(torch.bfloat16))


@interpreted
def test_refuses_shapes_it_cannot_read():
    y, x, a, b, slots, scalings = lora_inputs(5, [0, 1], 2, 8, 24, 20, torch.float32, "cpu")
    for bad, field in (
        ((y, x[:, :16], a, b, slots, scalings), "lora_a"),
        ((y, x, a, b[:, :10], slots, scalings), "lora_b"),
        ((y, x, a, b, slots[:3], scalings), "token_slots"),
        ((y, x, a, b, slots, scalings[:1]), "scalings"),
        ((y[:4], x, a, b, slots, scalings), "x"),
    ):
        with pytest.raises(ValueError, match=field):
            add_lora_kernel(*bad)
    with pytest.raises(ValueError, match="split_k"):
        add_lora_kernel(y, x, a, b, slots, scalings, split_k=0)
    empty = add_lora_kernel(y[:0], x[:0], a, b, slots[:0], scalings)
    assert empty.shape == (0, 20)


# -- the same checks with the compiled kernels ---------------------------------------------------

@pytest.mark.cuda
@compiled
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_conformance_and_ragged(dtype):
    check_conformance("cuda", dtype)
    for tokens, slots, rank, d_in, d_out in RAGGED + [(300, [5, -1, 0, 7, 3, 3, 1], 16, 1024, 576)]:
        check_against_reference(lora_inputs(tokens, slots, 8, rank, d_in, d_out, dtype, "cuda"), dtype)


@pytest.mark.cuda
@compiled
def test_gpu_split_k_views_and_cpu_fallback():
    for split_k in (1, 4):
        check_against_reference(lora_inputs(3, [1, 0, -1], 3, 16, 2048, 96, torch.bfloat16, "cuda"),
                                torch.bfloat16, split_k=split_k)
    check_strided_views("cuda")
    check_base_tokens_untouched("cuda")
    # CPU tensors with compiled Triton: the reference serves them.
    check_against_reference(lora_inputs(5, [0, -1, 1], 2, 8, 24, 20, torch.float32, "cpu"), torch.float32)
