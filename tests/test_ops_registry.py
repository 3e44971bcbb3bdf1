"""The custom-op registry: every kernel op has conformance cases, the CPU plugin's implementations
pass them, and a plugin's registrations reach the layers through bind_ops."""

from __future__ import annotations

import pluggy
import pytest
import torch

from sparrow import hookspecs
from sparrow.hookspecs import PROJECT_NAME, hookimpl
from sparrow.layers.activation import SiluAndMul
from sparrow.layers.layernorm import RMSNorm
from sparrow.ops import KERNEL_OPS, CustomOp, OpImpl, bind_ops, op_table, resolve_function_op
from sparrow.ops.check import op_cases, run_case
from sparrow.plugins import PluginError, build_registry, get_registry, import_object
from sparrow.sample.sampler import Sampler, apply_top_k_top_p, draw

CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.bfloat16)


# -- the cases ---------------------------------------------------------------------------------

@pytest.mark.parametrize("op", list(KERNEL_OPS))
def test_every_op_has_cases_that_the_reference_passes(op):
    for dtype in DTYPES:
        cases = op_cases(op, dtype, CPU)
        assert len(cases) >= 3, f"{op} has {len(cases)} cases"
        assert {case.op for case in cases} == {op}
        assert len({case.label for case in cases}) == len(cases), "labels name one case each"
        for case in cases:
            ok, detail = run_case(case, None)
            assert ok, f"{case.label}: {detail}"


@pytest.mark.parametrize("op", list(KERNEL_OPS))
def test_registered_cpu_implementations_pass_their_cases(op):
    impl_path = get_registry().ops.get(op, {}).get("cpu")
    if impl_path is None:
        pytest.skip(f"the CPU serves {op} with the reference")
    impl = import_object(impl_path) if isinstance(impl_path, str) else impl_path
    for dtype in DTYPES:
        for case in op_cases(op, dtype, CPU):
            ok, detail = run_case(case, impl)
            assert ok, f"{op} [{case.label}] {dtype}: {detail}"


def test_the_cpu_serves_the_hot_layer_ops_with_its_kernels():
    table = dict(op_table(["cpu"]))
    assert table["linear"]["cpu"] == table["lm_head"]["cpu"] == "sparrow_cpu.gemm:OneDnnLinear"
    assert table["rms_norm"]["cpu"] == "sparrow_cpu.fused:CppRMSNorm"
    assert table["embedding"]["cpu"] == table["draw"]["cpu"] == "native"


class _Perturbed(OpImpl):
    """The reference, off by a little: what a kernel with a bug looks like."""

    name = "perturbed"

    def __call__(self, *args):
        out = self.layer.forward_native(*args)
        first = out[0] if isinstance(out, tuple) else out
        first.add_(0.1)
        return out


def _raising(*_args):
    raise RuntimeError("kernel launch failed")


@pytest.mark.parametrize("op", ["linear", "rms_norm", "rotary_embedding", "silu_and_mul", "lm_head"])
def test_a_perturbed_layer_op_fails_with_its_error(op):
    case = op_cases(op, torch.float32, CPU)[1]
    ok, detail = run_case(case, _Perturbed)
    assert not ok and "max abs err" in detail


def test_perturbed_or_raising_function_ops_fail():
    top_k = op_cases("top_k_top_p", torch.float32, CPU)[-1]
    ok, detail = run_case(top_k, lambda logits, k, p: logits)  # filters nothing
    assert not ok and "differ" in detail
    ok, detail = run_case(top_k, _raising)
    assert not ok and detail == "raised RuntimeError: kernel launch failed"
    seeded = next(c for c in op_cases("draw", torch.float32, CPU) if c.label.startswith("all rows seeded"))
    ok, detail = run_case(seeded, lambda probs, *_: probs.argmax(dim=-1))  # ignores the uniforms
    assert not ok and "seeded row" in detail
    ok, detail = run_case(seeded, lambda probs, *_: (probs == 0).int().argmax(dim=-1))
    assert not ok and "zero-probability" in detail


def test_an_implementation_that_declines_a_layer_passes_as_the_reference():
    class Fp16Only(_Perturbed):
        @classmethod
        def supports(cls, layer):
            return False

    ok, detail = run_case(op_cases("rms_norm", torch.float32, CPU)[0], Fp16Only)
    assert ok and "not supported" in detail


# -- registration through a plugin manager ------------------------------------------------------

class DoubledSilu(OpImpl):
    """silu_and_mul times two: easy to tell from the reference."""

    name = "doubled"
    processed = 0

    def process_weights(self):
        type(self).processed += 1

    def __call__(self, x):
        return self.layer.forward_native(x) * 2


class TripledSilu(DoubledSilu):
    name = "tripled"

    def __call__(self, x):
        return self.layer.forward_native(x) * 3


def _top_k_top_p_keep_all(logits, top_k, top_p):
    return logits


def _registry(*plugins: tuple[str, object]):
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name, plugin in plugins:
        pm.register(plugin, name=name)
    return build_registry(pm)


def _ops_plugin(*registrations):
    class Plugin:
        @staticmethod
        @hookimpl
        def sparrow_register_ops(register):
            for args, kwargs in registrations:
                register(*args, **kwargs)
    return Plugin()


def test_sparrow_register_ops_binds_a_plugins_implementation_to_its_platforms_layers_only():
    registry = _registry(("npu_ops", _ops_plugin(
        (("silu_and_mul", "npu", DoubledSilu), {}),
        (("top_k_top_p", "npu", f"{__name__}:_top_k_top_p_keep_all"), {}))))
    model = torch.nn.Sequential(SiluAndMul(), SiluAndMul(), RMSNorm(8))
    model[2].weight.data.fill_(1.0)
    DoubledSilu.processed = 0
    assert bind_ops(model, "npu", registry=registry) == {"silu_and_mul": {"doubled": 2}, "rms_norm": {"native": 1}}
    assert isinstance(model[0].op_impl, DoubledSilu) and model[0].op_impl.layer is model[0]
    assert DoubledSilu.processed == 2  # weight post-processing ran once per layer
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[0](x), 2 * model[0].forward_native(x))
    assert "impl=doubled" in repr(model[0])
    # Another platform's layers keep the reference.
    assert bind_ops(model, "cpu", registry=registry) == {"silu_and_mul": {"native": 2}, "rms_norm": {"native": 1}}
    torch.testing.assert_close(model[0](x), model[0].forward_native(x))
    # Function ops: the registered function on its platform (imported from its path), else the reference.
    assert resolve_function_op("top_k_top_p", "npu", registry) is _top_k_top_p_keep_all
    assert resolve_function_op("top_k_top_p", "cpu", registry) is apply_top_k_top_p
    assert resolve_function_op("draw", "npu", registry) is draw
    with pytest.raises(ValueError, match="layer op"):
        resolve_function_op("linear", "npu", registry)
    assert dict(op_table(["npu", "cpu"], registry))["silu_and_mul"] == {"npu": "doubled", "cpu": "native"}


def test_override_replaces_and_a_duplicate_names_both_plugins():
    first = ("vendor_a", _ops_plugin((("silu_and_mul", "npu", DoubledSilu), {})))
    registry = _registry(first, ("vendor_b", _ops_plugin((("silu_and_mul", "npu", TripledSilu),
                                                            {"override": True}))))
    layer = SiluAndMul()
    assert bind_ops(layer, "npu", registry=registry) == {"silu_and_mul": {"tripled": 1}}
    with pytest.raises(PluginError, match="registered by both 'vendor_a' and 'vendor_b'") as info:
        _registry(first, ("vendor_b", _ops_plugin((("silu_and_mul", "npu", TripledSilu), {}))))
    assert "silu_and_mul on npu" in str(info.value)


def test_an_unknown_op_or_a_function_for_a_layer_op_is_an_error():
    with pytest.raises(PluginError, match="'typo_plugin' registered an implementation of unknown op 'rms_nrom'"):
        _registry(("typo_plugin", _ops_plugin((("rms_nrom", "npu", DoubledSilu), {}))))
    registry = _registry(("confused", _ops_plugin((("silu_and_mul", "npu", _top_k_top_p_keep_all), {}))))
    with pytest.raises(TypeError, match="layer op 'silu_and_mul' registered for platform 'npu' must be a "
                                        "sparrow.ops.OpImpl subclass"):
        bind_ops(SiluAndMul(), "npu", registry=registry)


def test_overrides_win_over_the_registry():
    # How a quantization method serves an op in place of the platform's implementation.
    registry = _registry(("vendor_a", _ops_plugin((("silu_and_mul", "npu", DoubledSilu), {}))))
    layer = SiluAndMul()
    assert bind_ops(layer, "npu", registry=registry, overrides={"silu_and_mul": TripledSilu}) == {
        "silu_and_mul": {"tripled": 1}}


def test_the_sampler_resolves_its_function_ops_for_its_platform(monkeypatch):
    registry = _registry(("npu_ops", _ops_plugin((("top_k_top_p", "npu", _top_k_top_p_keep_all), {}))))
    monkeypatch.setattr("sparrow.plugins.get_registry", lambda pm=None: registry)
    sampler = Sampler(torch.Generator().manual_seed(0), "npu")
    assert sampler.top_k_top_p is _top_k_top_p_keep_all and sampler.draw is draw
    assert Sampler().top_k_top_p is apply_top_k_top_p


def test_a_loaded_model_is_bound_on_the_cpu(qwen3_dir):
    from sparrow.model_loader import load_model
    from sparrow_cpu.attention import TorchPagedAttention
    from sparrow_cpu.gemm import packed_linear_available

    model = load_model(qwen3_dir, TorchPagedAttention, torch.float32, "cpu")
    layers = [m for m in model.modules() if isinstance(m, CustomOp)]
    summary = bind_ops(model, "cpu")
    counts = {op: sum(c.values()) for op, c in summary.items()}
    assert counts == {op: sum(1 for m in layers if m.op_name == op) for op in counts}
    assert summary["embedding"] == {"native": 1}
    if packed_linear_available():
        assert summary["linear"] == {"onednn_packed": counts["linear"]}
        assert all(m.weight.is_mkldnn for m in layers if m.op_name == "linear")
