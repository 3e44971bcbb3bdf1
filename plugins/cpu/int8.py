"""int8 W8A8 ``linear`` on the CPU (``quantization="int8"``, sparrow.quantization.int8).

Weights: int8 per output channel, quantized once when the model is bound and packed for the GEMM;
the dense weight is released, so the linear layers take a quarter of their fp32 memory.
Activations: int8 per token, computed on every call, as uint8 with zero point 128; the GEMM
accumulates in int32 and scales by the weight's per-channel scales and the token's scale, and adds
the bias. Two GEMMs:

* on CPUs with AVX512-VNNI, our own kernel (sparrow_cpu.int8_gemm): quantization, GEMM and
  rescale in one C++ call, weights in its own packed layout;
* elsewhere, oneDNN's (``torch.ops.onednn.qlinear_prepack`` / ``qlinear_pointwise``), with the
  quantization and the rescale as two small C++ passes around it (built like
  sparrow_cpu.native's, torch ops when no compiler is present).
  ``SPARROW_CPU_INT8_GEMM=onednn`` picks this one on a VNNI CPU too.

Measured on the 2-vCPU AMD EPYC VM (AVX2, no VNNI), oneDNN's int8 GEMM runs the benchmark model's
shapes 1.3-1.9x faster than its fp32 GEMM with packed weights; ``torch._int_mm`` and
``torch._weight_int8pack_mm`` are 10-50x slower than fp32 there (reference loops), and fbgemm's
dynamic linear quantizes activations per tensor, not per token.

Without VNNI, x86 multiplies u8 x s8 pairs into saturating int16 sums (``vpmaddubsw``), so a pair of
full-range products can overflow: weights are then kept within [-63, 63] (7 bits; 2 * 255 * 63 <
32767), which keeps activations at full 8-bit resolution per token (outlier-prone activations
need it more than weights do). CPUs with VNNI (AVX512-VNNI, AVX-VNNI, AMX) accumulate in int32
directly and use the full [-127, 127].
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from sparrow.ops.base import OpImpl
from sparrow.quantization.int8 import INT8_MAX

logger = logging.getLogger(__name__)

ACTIVATION_ZERO_POINT = 128

# The activation side in one pass each way (torch spends ~8 element-wise kernels per call, each its
# own parallel region, which costs most at decode sizes): per-token int8 quantization to uint8
# with zero point 128, and the per-token rescale plus bias of the float32 GEMM output.
SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

static inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// One row to uint8 with zero point 128, returning its scale; the padding up to k_padded (our VNNI
// kernel's multiple of 4) is 128, a zero.
static inline float quantize_row(const float* row, int64_t k, int64_t k_padded, uint8_t* out) {
  float amax = 0.f;
#pragma omp simd reduction(max:amax)
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  // x / s (not x * (1 / s)): the same rounding as torch's reference, ties to even.
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) out[i] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(row[i] / s)) + 128);
  for (int64_t i = k; i < k_padded; ++i) out[i] = 128;
  return s;
}

void quantize_rows_u8(at::Tensor out, at::Tensor scale, const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 [M, K]");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous(), "out: contiguous uint8 [M, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale: float32 [M]");
  const int64_t m = x.size(0), k = x.size(1);
  const float* xp = x.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, m, grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) sp[r] = quantize_row(xp + r * k, k, k, op + r * k);
  });
}

void scale_rows(at::Tensor out, const at::Tensor& scale, const at::Tensor& bias) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2, "out: contiguous float32");
  const int64_t m = out.size(0), n = out.size(1);
  float* op = out.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const bool has_bias = bias.numel() > 0;
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, m, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = op + r * n;
      const float s = sp[r];
      if (has_bias) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) row[i] = row[i] * s + bp[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) row[i] *= s;
      }
    }
  });
}
"""


@functools.lru_cache(maxsize=1)
def native_kernels() -> Any:
    """The two activation kernels above, built once (sparrow_cpu.kernel_build), or None: torch."""
    import os

    if os.environ.get("SPARROW_CPU_NATIVE", "1") == "0":
        return None
    from sparrow_cpu.kernel_build import KernelBuild, load_kernels

    try:
        from sparrow_cpu.int8_gemm import SOURCE as GEMM_SOURCE

        return load_kernels(KernelBuild(name="sparrow_cpu_int8", sources=(SOURCE, GEMM_SOURCE),
                                        functions=("quantize_rows_u8", "scale_rows", "vnni_gemm_available",
                                                   "vnni_pack", "int8_linear"),
                                        cflags=("-O3", "-march=native", "-fopenmp"), ldflags=("-fopenmp",)))
    except Exception as exc:  # noqa: BLE001 - any build failure falls back to plain torch
        logger.warning("int8 activation kernels unavailable, using torch: %s", exc)
        return None


@functools.lru_cache(maxsize=1)
def vnni_kernels() -> Any:
    """The kernels when they include our own AVX512-VNNI linear (sparrow_cpu.int8_gemm), else None.

    ``SPARROW_CPU_INT8_GEMM=onednn`` keeps oneDNN's int8 GEMM (to compare the two)."""
    import os

    choice = os.environ.get("SPARROW_CPU_INT8_GEMM", "auto")
    if choice not in ("auto", "onednn"):
        raise ValueError(f"SPARROW_CPU_INT8_GEMM must be 'auto' or 'onednn', got {choice!r}")
    native = native_kernels()
    if choice == "onednn" or native is None or not native.vnni_gemm_available():
        logger.info("int8 GEMM: oneDNN's (%s)", "SPARROW_CPU_INT8_GEMM=onednn" if choice == "onednn"
                    else "no AVX512-VNNI kernel for this CPU and compiler")
        return None
    logger.info("int8 GEMM: Sparrow's AVX512-VNNI kernel (SPARROW_CPU_INT8_GEMM=onednn picks oneDNN's)")
    return native


@functools.lru_cache(maxsize=1)
def has_vnni() -> bool:
    """Whether oneDNN's int8 kernels here accumulate without int16 saturation."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "").split()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def weight_max() -> int:
    return INT8_MAX if has_vnni() else 63


@functools.lru_cache(maxsize=1)
def onednn_int8_available() -> bool:
    """Whether this torch build has oneDNN's int8 linear and it computes correctly (probed once)."""
    if not (hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_prepack")):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(-127, 128, (3, 64), generator=gen, dtype=torch.int32)
        w = torch.randint(-weight_max(), weight_max() + 1, (24, 64), generator=gen, dtype=torch.int32)
        scales = torch.ones(24)
        got = _gemm(((x + ACTIVATION_ZERO_POINT).to(torch.uint8)), _prepack(w.to(torch.int8)), scales)
        return torch.equal(got, (x @ w.t()).float())
    except Exception as exc:  # noqa: BLE001 - an unusual build: the method refuses to bind
        logger.warning("oneDNN int8 linear unavailable: %s", exc)
        return False


def _prepack(weight_int8: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(weight_int8.contiguous(), None)


def _gemm(x_u8: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``(x_u8 - 128) @ W^T * weight_scale`` in float32, accumulated in int32."""
    zero_points = torch.zeros(weight_scale.shape[0], dtype=torch.long)
    return torch.ops.onednn.qlinear_pointwise(x_u8, 1.0, ACTIVATION_ZERO_POINT, packed, weight_scale, zero_points,
                                              None, 1.0, 0, torch.float32, "none", [], "")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: ``(q int8 [N, K] within +-weight_max(), scale float32 [N])``."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / weight_max()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale.unsqueeze(1)).clamp_(-weight_max(), weight_max()).to(torch.int8), scale


class Int8Linear(OpImpl):
    """``x @ W^T + b`` with int8 weights per channel and int8 activations per token (oneDNN)."""

    name = "int8_w8a8"

    @classmethod
    def supports(cls, layer: Any) -> bool:
        weight = getattr(layer, "weight", None)
        return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point()
                and weight.device.type == "cpu" and not weight.is_mkldnn
                and (vnni_kernels() is not None or onednn_int8_available()))

    def process_weights(self) -> None:
        layer = self.layer
        q, scale = quantize_weight(layer.weight.data)
        self.out_features, self.in_features = q.shape
        self.native = native_kernels()
        self.no_bias = torch.empty(0)
        self.vnni = vnni_kernels()
        if self.vnni is not None:
            # Our own kernel's layout (sparrow_cpu.int8_gemm); the zero point's correction needs
            # each channel's sum of weights.
            self.colsum = q.sum(dim=1, dtype=torch.int32)
            layer.replace_parameter("weight", self.vnni.vnni_pack(q))
            layer.replace_parameter("weight_scale", scale)
            return
        # The int8 weight itself, in oneDNN's packed layout, replaces the dense one.
        layer.replace_parameter("weight", _prepack(q))
        layer.replace_parameter("weight_scale", scale)
        self.zero_points = torch.zeros(q.shape[0], dtype=torch.long)
        self._qlinear = torch.ops.onednn.qlinear_pointwise  # looked up once, not per call

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layer
        x2 = x.reshape(-1, x.shape[-1])
        if self.vnni is not None:
            if x2.dtype != torch.float32 or x2.stride(-1) != 1:
                x2 = x2.float().contiguous()
            out = self.vnni.int8_linear(x2, layer.weight, self.in_features, self.colsum, layer.weight_scale,
                                        self.no_bias if bias is None else bias.float().contiguous())
            return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if x2.shape[0] == 0:  # oneDNN rejects empty inputs
            return x.new_empty(*x.shape[:-1], self.out_features)
        xf = x2.float().contiguous()
        native = self.native
        # Per token: s = max|x| / 127, q = round(x / s) + 128 in [1, 255].
        if native is not None:
            x_u8 = torch.empty(xf.shape, dtype=torch.uint8)
            x_scale = torch.empty(xf.shape[0], dtype=torch.float32)
            native.quantize_rows_u8(x_u8, x_scale, xf)
        else:
            x_scale = xf.abs().amax(dim=1, keepdim=True).div_(INT8_MAX)
            x_scale = torch.where(x_scale > 0, x_scale, torch.ones_like(x_scale))
            x_u8 = torch.div(xf, x_scale).round_().add_(ACTIVATION_ZERO_POINT).to(torch.uint8)
        out = self._qlinear(x_u8, 1.0, ACTIVATION_ZERO_POINT, layer.weight, layer.weight_scale, self.zero_points,
                            None, 1.0, 0, torch.float32, "none", [], "")
        if native is not None:
            native.scale_rows(out, x_scale, self.no_bias if bias is None else bias.float().contiguous())
        else:
            out.mul_(x_scale)
            if bias is not None:
                out.add_(bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


# -- mixture-of-experts ------------------------------------------------------------------------
def quantize_weight_rows(weight: torch.Tensor, row_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_weight` with each row's ``max|w|`` given (a row split across ranks needs
    the whole row's): ``(q int8 [N, K], scale float32 [N])``."""
    scale = row_amax.float() / weight_max()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(weight.float() / scale.unsqueeze(1)).clamp_(-weight_max(), weight_max()).to(torch.int8), scale


def quantize_activations(xf: torch.Tensor, native: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a contiguous float32 ``[M, K]``: ``(uint8 [M, K] with zero point 128, scale [M])``."""
    if native is not None:
        x_u8 = torch.empty(xf.shape, dtype=torch.uint8)
        x_scale = torch.empty(xf.shape[0], dtype=torch.float32)
        native.quantize_rows_u8(x_u8, x_scale, xf)
        return x_u8, x_scale
    x_scale = xf.abs().amax(dim=1).div_(INT8_MAX)
    x_scale = torch.where(x_scale > 0, x_scale, torch.ones_like(x_scale))
    return torch.div(xf, x_scale.unsqueeze(1)).round_().add_(ACTIVATION_ZERO_POINT).to(torch.uint8), x_scale


class Int8FusedMoE(OpImpl):
    """The ``fused_moe`` op with int8 experts: per expert, per output channel int8 ``gate_up_proj``
    and ``down_proj`` (one packed weight per expert, in our VNNI kernel's layout or oneDNN's), int8
    activations per token.

    Like the torch reference, the (token, expert) pairs are grouped by expert and each expert with
    routed tokens runs one int8 GEMM over just those rows (the loop is over experts, not tokens);
    the routing-weighted sum is the reference's. The gated activation is quantized per row before
    ``down_proj``.
    """

    name = "int8_w8a8_moe"

    @classmethod
    def supports(cls, layer: Any) -> bool:
        stacks = (getattr(layer, "gate_up_proj", None), getattr(layer, "down_proj", None))
        return (all(isinstance(w, torch.Tensor) and w.dim() == 3 and w.is_floating_point()
                    and w.device.type == "cpu" and not w.is_mkldnn for w in stacks)
                and (vnni_kernels() is not None or onednn_int8_available()))

    def process_weights(self) -> None:
        layer = self.layer
        gate_up, down = layer.gate_up_proj.data, layer.down_proj.data
        self.inter = gate_up.shape[1] // 2
        # down_proj is row-parallel (ranks split its input, the intermediate size): its per-channel
        # scales come from whole rows, so every rank's int8 slice is the single-device one's.
        down_amax = down.float().abs().amax(dim=2)  # [E, H]
        if layer.tp.world_size > 1:
            down_amax = layer.tp.all_gather(down_amax.unsqueeze(-1), dim=-1).amax(dim=-1)
        self.vnni = vnni_kernels()
        pack = _prepack if self.vnni is None else self.vnni.vnni_pack
        packed: dict[str, list[torch.Tensor]] = {"gate_up_proj": [], "down_proj": []}
        scales: dict[str, list[torch.Tensor]] = {"gate_up_proj": [], "down_proj": []}
        # Our kernel's zero-point correction needs each channel's sum of weights.
        self.colsums: dict[str, list[torch.Tensor]] = {"gate_up_proj": [], "down_proj": []}
        self.in_features = {"gate_up_proj": gate_up.shape[2], "down_proj": self.inter}
        for expert in range(gate_up.shape[0]):
            for name, weight, amax in (("gate_up_proj", gate_up[expert], gate_up[expert].float().abs().amax(dim=1)),
                                       ("down_proj", down[expert], down_amax[expert])):
                q, scale = quantize_weight_rows(weight, amax)
                packed[name].append(pack(q))
                scales[name].append(scale)
                if self.vnni is not None:
                    self.colsums[name].append(q.sum(dim=1, dtype=torch.int32))
        del gate_up, down
        for name in packed:
            # The dense stack is released; the same name now holds one packed int8 weight per expert.
            delattr(layer, name)
            setattr(layer, name, torch.nn.ParameterList(torch.nn.Parameter(w, requires_grad=False)
                                                        for w in packed[name]))
        layer.replace_parameter("gate_up_scale", torch.stack(scales["gate_up_proj"]))  # [E, 2I]
        layer.replace_parameter("down_scale", torch.stack(scales["down_proj"]))  # [E, H]
        # No ParameterList lookups per call.
        self.packed = {"gate_up_proj": list(layer.gate_up_proj), "down_proj": list(layer.down_proj)}
        self.scales = {"gate_up_proj": layer.gate_up_scale, "down_proj": layer.down_scale}
        self.zero_points = {name: torch.zeros(scale.shape[1], dtype=torch.long) for name, scale in self.scales.items()}
        self._qlinear = torch.ops.onednn.qlinear_pointwise
        self.native = native_kernels()
        self.no_bias = torch.empty(0)

    def _project(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], name: str, expert: int) -> torch.Tensor:
        """One expert's ``gate_up_proj`` or ``down_proj`` of its rows, float32 out: ``x`` float32
        rows, or (oneDNN only) rows already quantized as ``(uint8, scale)``."""
        packed, weight_scale = self.packed[name][expert], self.scales[name][expert]
        if self.vnni is not None:
            return self.vnni.int8_linear(x, packed, self.in_features[name], self.colsums[name][expert], weight_scale,
                                         self.no_bias)
        x_u8, x_scale = x if isinstance(x, tuple) else quantize_activations(x, self.native)
        out = self._qlinear(x_u8, 1.0, ACTIVATION_ZERO_POINT, packed, weight_scale, self.zero_points[name],
                            None, 1.0, 0, torch.float32, "none", [], "")
        if self.native is not None:
            self.native.scale_rows(out, x_scale, self.no_bias)
        else:
            out.mul_(x_scale.unsqueeze(1))
        return out

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        num_tokens, top_k = topk_ids.shape
        hidden_size = hidden.shape[1]
        if num_tokens == 0:
            return torch.zeros(0, hidden_size, dtype=hidden.dtype, device=hidden.device)
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # [T*k] pair indices grouped by expert
        token_of_pair = order // top_k
        counts = torch.bincount(flat_ids, minlength=layer.num_experts).tolist()
        if self.vnni is not None:
            # Our kernel quantizes the rows it is given (the same per-row int8), once per (token,
            # expert) pair: a pass that costs little next to the GEMM.
            x_f = hidden.float().index_select(0, token_of_pair)
            take = lambda rows: x_f[rows]  # noqa: E731
        else:
            # Each token quantized once, however many experts it goes to; its int8 rows gathered.
            x_u8, x_scale = quantize_activations(hidden.float().contiguous(), self.native)
            x_u8, x_scale = x_u8.index_select(0, token_of_pair), x_scale.index_select(0, token_of_pair)
            take = lambda rows: (x_u8[rows], x_scale[rows])  # noqa: E731
        expert_out = torch.empty(flat_ids.shape[0], hidden_size, dtype=torch.float32)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate_up = self._project(take(rows), "gate_up_proj", expert)  # [n, 2I]
            act = torch.nn.functional.silu(gate_up[:, :self.inter]).mul_(gate_up[:, self.inter:])
            expert_out[rows] = self._project(act, "down_proj", expert)  # [n, H]
            start += count
        # The reference's mixing: expert outputs in the model's dtype times the routing weights.
        weighted = (expert_out.to(hidden.dtype) * topk_weights.reshape(-1)[order].unsqueeze(1)).to(hidden.dtype)
        out = torch.zeros(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
        return out.index_add_(0, token_of_pair, weighted)
