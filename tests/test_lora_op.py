"""The ``add_lora`` reference against a token-by-token loop, on its own conformance cases."""

from __future__ import annotations

import pytest
import torch

from sparrow.lora.ops import add_lora, add_lora_cases
from sparrow.ops import KERNEL_OPS, resolve_function_op


def _per_token(y, x, lora_a, lora_b, token_slots, scalings):
    out = y.clone().double()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] += scalings[slot].double() * (lora_b[slot].double() @ (lora_a[slot].double() @ x[t].double()))
    return out


@pytest.mark.parametrize("case", add_lora_cases(torch.float32, torch.device("cpu")), ids=lambda c: c.label)
def test_reference_equals_a_per_token_loop(case):
    expected = _per_token(*case.args)
    got = add_lora(*(arg.clone() for arg in case.args))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    base = case.args[4] < 0
    torch.testing.assert_close(got[base], case.args[0][base])  # base tokens untouched


def test_add_lora_is_a_registered_function_op_served_natively_on_cpu():
    assert KERNEL_OPS["add_lora"].kind == "function"
    assert resolve_function_op("add_lora", "cpu") is add_lora
