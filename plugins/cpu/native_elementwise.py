"""C++ source of the CPU element-wise layers (built by ``sparrow_cpu.native``), fp32 only.

Each kernel is one pass over its rows, split across torch's threads:

* ``rms_norm(out, x, weight, eps)``: x is ``[A, B, D]`` with a unit inner stride and any outer
  strides (the q/k heads of a fused QKV output); out is contiguous ``[A, B, D]``.
* ``fused_add_rms_norm(x, residual, weight, eps)``: in place, ``residual += x`` and then
  ``x = rms_norm(residual)``; both contiguous ``[N, D]``.
* ``rotary_neox(positions, query, key, cos_sin_cache, rotary_dim)``: in place on ``[T, H, D]``
  views (unit inner stride), the first ``rotary_dim`` dims of every head rotated by the angles of
  its token's position; ``cos_sin_cache`` is ``[max_position, rotary_dim]`` (cos half, sin half).
* ``silu_and_mul(out, x)``: ``out = silu(x[:, :d]) * x[:, d:]`` for contiguous ``x`` ``[N, 2d]``.

Arithmetic follows the torch layers (fp32 statistics, ``x * rsqrt(mean(x^2) + eps) * w``); only
the summation order differs, within a few ulp.
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

// Rows per task so that each task touches at least ~16k floats.
static inline int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems));
}

static inline void rms_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+:sum)
  for (int64_t i = 0; i < d; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = (x[i] * inv) * w[i];
}

static void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, " must be a float32 CPU tensor");
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_float(out, "out"); check_float(x, "x"); check_float(weight, "weight");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [A, B, D] with a unit inner stride");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), "out must be contiguous and shaped like x");
  const int64_t A = x.size(0), B = x.size(1), D = x.size(2);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == D, "weight must have D elements");
  const int64_t sa = x.stride(0), sb = x.stride(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, A * B, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t a = r / B, b = r % B;
      rms_row(xp + a * sa + b * sb, wp, op + r * D, D, feps);
    }
  });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_float(x, "x"); check_float(residual, "residual"); check_float(weight, "weight");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "x and residual must be contiguous and of one shape");
  const int64_t D = x.size(-1), N = x.numel() / std::max<int64_t>(1, D);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == D, "weight must have D elements");
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, N, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * D;
      float* rr = rp + r * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) rr[i] += xr[i];
      rms_row(rr, wp, xr, D, feps);
    }
  });
}

static inline void rotate_heads(float* base, int64_t heads, int64_t head_stride, const float* cos,
                                const float* sin, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = base + h * head_stride;
    float* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

void rotary_neox(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor cos_sin_cache,
                 int64_t rotary_dim) {
  check_float(query, "query"); check_float(key, "key"); check_float(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be contiguous int64");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1,
              "query and key must be [T, H, D] with a unit inner stride");
  TORCH_CHECK(cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) == rotary_dim && rotary_dim % 2 == 0,
              "cos_sin_cache must be contiguous [max_position, rotary_dim]");
  const int64_t T = positions.numel();
  TORCH_CHECK(query.size(0) >= T && key.size(0) >= T, "query and key need a row per position");
  TORCH_CHECK(rotary_dim <= query.size(2) && rotary_dim <= key.size(2), "rotary_dim exceeds head_dim");
  const int64_t max_position = cos_sin_cache.size(0), half = rotary_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " outside the rotary cache of ",
                max_position);
  }
  float* qp = query.data_ptr<float>();
  float* kp = key.data_ptr<float>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  const int64_t q_heads = query.size(1), k_heads = key.size(1);
  const int64_t q_row = query.stride(0), q_head = query.stride(1), k_row = key.stride(0), k_head = key.stride(1);
  at::parallel_for(0, T, row_grain((q_heads + k_heads) * rotary_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + pos[t] * rotary_dim;
      const float* sin = cos + half;
      rotate_heads(qp + t * q_row, q_heads, q_head, cos, sin, half);
      rotate_heads(kp + t * k_row, k_heads, k_head, cos, sin, half);
    }
  });
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_float(out, "out"); check_float(x, "x");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "x and out must be contiguous");
  const int64_t d = out.size(-1), N = out.numel() / std::max<int64_t>(1, d);
  TORCH_CHECK(x.size(-1) == 2 * d && x.numel() == 2 * out.numel(), "x must be [N, 2d] for out [N, d]");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, row_grain(3 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * 2 * d;
      const float* up = gate + d;
      float* o = op + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
}
"""
