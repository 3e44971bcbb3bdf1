"""C++ source of the CPU's own int8 linear for AVX512-VNNI (built with sparrow_cpu.int8's kernels).

One call does the whole W8A8 linear: quantize each row of the float32 input to uint8 (zero point
128, ``s = max|x| / 127``: ``quantize_row`` of sparrow_cpu.int8's source, built into the same
extension), multiply with ``vpdpbusd``
(four u8 x s8 products summed into int32, no saturation), and in the epilogue remove the zero
point (``acc - 128 * colsum(w)``), scale by the weight's channel scale and the row's scale and add
the bias. oneDNN's int8 linear computes the same int32 sums but builds its primitive descriptor on
the host on every call (25-40 us, measured on an Intel Xeon VM: most of a decode step's
small products), and needs two more passes (quantize, rescale) and several torch calls around it.

Weights are packed once, ``q int8 [N, K] -> [ceil(N/16), ceil(K/4), 16, 4]`` with zeros as
padding: one 64-byte load gives 16 output channels times 4 consecutive inputs, the operand layout
of ``vpdpbusd``. A tile computes 4 rows times 64 channels (16 int32 accumulators in registers);
the work is split over (row block, 64-channel block) items across torch's threads (32- or
16-channel blocks when there would be fewer than two items per thread).

Compiled only where the compiler targets AVX512-VNNI (``-march=native``); elsewhere
``vnni_gemm_available()`` is false and the caller keeps oneDNN.
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SPARROW_VNNI 1
#endif

bool vnni_gemm_available() {
#ifdef SPARROW_VNNI
  return true;
#else
  return false;
#endif
}

// q int8 [N, K] -> [ceil(N/16), ceil(K/4), 16, 4]: panel p holds channels 16p..16p+15.
at::Tensor vnni_pack(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q: contiguous int8 [N, K]");
  const int64_t n = q.size(0), k = q.size(1), panels = (n + 15) / 16, k4 = (k + 3) / 4;
  at::Tensor out = at::zeros({panels, k4, 16, 4}, q.options());
  const int8_t* src = q.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  for (int64_t c = 0; c < n; ++c)
    for (int64_t i = 0; i < k; ++i)
      dst[(((c / 16) * k4 + i / 4) * 16 + c % 16) * 4 + i % 4] = src[c * k + i];
  return out;
}

#ifdef SPARROW_VNNI
// One 16-channel group of a row: remove the zero point, scale, add the bias, store (masked).
static inline void emit_group(int r, int p, __m512i acc, const int32_t* colsum, const float* w_scale,
                              const float* bias, const float* x_scale, float* out, int64_t ldo, int64_t valid_cols) {
  const int64_t left = valid_cols - 16 * p;
  const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
  const __m512i zero_point = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, colsum + 16 * p), 7);
  const __m512 ws = _mm512_maskz_loadu_ps(mask, w_scale + 16 * p);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + 16 * p) : _mm512_setzero_ps();
  const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, zero_point));
  const __m512 y = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(sums, ws), _mm512_set1_ps(x_scale[r])), bv);
  _mm512_mask_storeu_ps(out + r * ldo + 16 * p, mask, y);
}

static inline int32_t load_quad(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ROWS x (16 * PANELS) outputs (ROWS, PANELS <= 4): a [ROWS, k4 * 4] uint8 rows, w the first
// panel, panel_stride bytes between panels. Epilogue: (acc - 128 * colsum) * w_scale * x_scale
// (+ bias), masked at the last channel. The accumulators are named variables, stored to memory for
// the epilogue: with an array, or with the epilogue reading them in registers, GCC 12 copies each
// accumulator around every vpdpbusd (33 register moves per 16 products in the inner loop).
#define SPARROW_DP(r, p) \
  if constexpr (r < ROWS && p < PANELS) c##r##p = _mm512_dpbusd_epi32(c##r##p, a##r, wv);
#define SPARROW_DP_PANEL(p)                                                          \
  if constexpr (p < PANELS) {                                                        \
    const __m512i wv = _mm512_loadu_si512(w + p * panel_stride + kk * 64);          \
    SPARROW_DP(0, p) SPARROW_DP(1, p) SPARROW_DP(2, p) SPARROW_DP(3, p)             \
  }
#define SPARROW_EMIT(r, p) \
  if constexpr (r < ROWS && p < PANELS) _mm512_store_si512(&acc[r * 4 + p], c##r##p);

template <int ROWS, int PANELS>
static inline void tile(const uint8_t* a, int64_t lda, const int8_t* w, int64_t panel_stride, int64_t k4,
                        const int32_t* colsum, const float* w_scale, const float* bias, const float* x_scale,
                        float* out, int64_t ldo, int64_t valid_cols) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i c00 = zero, c01 = zero, c02 = zero, c03 = zero, c10 = zero, c11 = zero, c12 = zero, c13 = zero;
  __m512i c20 = zero, c21 = zero, c22 = zero, c23 = zero, c30 = zero, c31 = zero, c32 = zero, c33 = zero;
  for (int64_t kk = 0; kk < k4; ++kk) {
    __m512i a0 = zero, a1 = zero, a2 = zero, a3 = zero;  // one row's 4 bytes in every lane
    if constexpr (ROWS > 0) a0 = _mm512_set1_epi32(load_quad(a + kk * 4));
    if constexpr (ROWS > 1) a1 = _mm512_set1_epi32(load_quad(a + lda + kk * 4));
    if constexpr (ROWS > 2) a2 = _mm512_set1_epi32(load_quad(a + 2 * lda + kk * 4));
    if constexpr (ROWS > 3) a3 = _mm512_set1_epi32(load_quad(a + 3 * lda + kk * 4));
    SPARROW_DP_PANEL(0) SPARROW_DP_PANEL(1) SPARROW_DP_PANEL(2) SPARROW_DP_PANEL(3)
  }
  alignas(64) __m512i acc[16];
  SPARROW_EMIT(0, 0) SPARROW_EMIT(0, 1) SPARROW_EMIT(0, 2) SPARROW_EMIT(0, 3)
  SPARROW_EMIT(1, 0) SPARROW_EMIT(1, 1) SPARROW_EMIT(1, 2) SPARROW_EMIT(1, 3)
  SPARROW_EMIT(2, 0) SPARROW_EMIT(2, 1) SPARROW_EMIT(2, 2) SPARROW_EMIT(2, 3)
  SPARROW_EMIT(3, 0) SPARROW_EMIT(3, 1) SPARROW_EMIT(3, 2) SPARROW_EMIT(3, 3)
  for (int r = 0; r < ROWS; ++r)
    for (int p = 0; p < PANELS; ++p)
      emit_group(r, p, acc[r * 4 + p], colsum, w_scale, bias, x_scale, out, ldo, valid_cols);
}
#undef SPARROW_DP
#undef SPARROW_DP_PANEL
#undef SPARROW_EMIT

template <int ROWS>
static inline void tile_cols(int panels, const uint8_t* a, int64_t lda, const int8_t* w, int64_t panel_stride,
                             int64_t k4, const int32_t* colsum, const float* w_scale, const float* bias,
                             const float* x_scale, float* out, int64_t ldo, int64_t valid_cols) {
  switch (panels) {
    case 4: tile<ROWS, 4>(a, lda, w, panel_stride, k4, colsum, w_scale, bias, x_scale, out, ldo, valid_cols); break;
    case 3: tile<ROWS, 3>(a, lda, w, panel_stride, k4, colsum, w_scale, bias, x_scale, out, ldo, valid_cols); break;
    case 2: tile<ROWS, 2>(a, lda, w, panel_stride, k4, colsum, w_scale, bias, x_scale, out, ldo, valid_cols); break;
    default: tile<ROWS, 1>(a, lda, w, panel_stride, k4, colsum, w_scale, bias, x_scale, out, ldo, valid_cols);
  }
}
#endif

// x float32 [M, K] -> [M, N]: quantized per row, times the packed weight (of K = in_features
// inputs), rescaled, plus bias.
// colsum int32 [N]: each channel's sum of its int8 weights; bias: float32 [N] or empty.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t in_features, const at::Tensor& colsum,
                       const at::Tensor& w_scale, const at::Tensor& bias) {
#ifdef SPARROW_VNNI
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "x: float32 [M, K], unit inner stride");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous(),
              "packed: vnni_pack's output");
  const int64_t m = x.size(0), k = x.size(1), n = w_scale.size(0), k4 = packed.size(1);
  TORCH_CHECK(k == in_features && k4 == (k + 3) / 4 && packed.size(0) == (n + 15) / 16,
              "x's columns or w_scale's size do not match the packed weight");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == n, "colsum: int32 [N]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(), "w_scale: float32 [N]");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n),
              "bias: float32 [N]");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const int64_t lda = k4 * 4, panel_stride = k4 * 64;
  at::Tensor a = at::empty({m, lda}, x.options().dtype(at::kByte));
  at::Tensor x_scale = at::empty({m}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  uint8_t* ap = a.data_ptr<uint8_t>();
  float* sp = x_scale.data_ptr<float>();
  at::parallel_for(0, m, grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) sp[r] = quantize_row(xp + r * ldx, k, lda, ap + r * lda);
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cp = colsum.data_ptr<int32_t>();
  const float* wsp = w_scale.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Items: 64-row blocks x 64-channel blocks, channel blocks inner (consecutive items share rows).
  // Narrower channel blocks (32, 16) when that leaves fewer than two items per thread (a decode
  // step's few rows on many cores).
  const int64_t row_block = 64, row_blocks = (m + row_block - 1) / row_block;
  const int64_t threads = at::get_num_threads();
  int64_t block_cols = 64;
  while (block_cols > 16 && row_blocks * ((n + block_cols - 1) / block_cols) < 2 * threads) block_cols /= 2;
  const int64_t col_blocks = (n + block_cols - 1) / block_cols;
  at::parallel_for(0, row_blocks * col_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t rb = item / col_blocks, cb = item % col_blocks;
      const int64_t c0 = cb * block_cols, cols = std::min<int64_t>(block_cols, n - c0);
      const int panels = static_cast<int>((cols + 15) / 16);
      const int8_t* w = wp + (c0 / 16) * panel_stride;
      const int64_t r_end = std::min(m, (rb + 1) * row_block);
      auto rows = [&](auto count, int64_t r) {  // count: the tile's rows, a compile-time constant
        tile_cols<decltype(count)::value>(panels, ap + r * lda, lda, w, panel_stride, k4, cp + c0, wsp + c0,
                                          bp ? bp + c0 : nullptr, sp + r, op + r * n + c0, n, cols);
      };
      int64_t r = rb * row_block;
      for (; r + 4 <= r_end; r += 4) rows(std::integral_constant<int, 4>{}, r);
      switch (r_end - r) {
        case 3: rows(std::integral_constant<int, 3>{}, r); break;
        case 2: rows(std::integral_constant<int, 2>{}, r); break;
        case 1: rows(std::integral_constant<int, 1>{}, r); break;
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "int8_linear needs a compiler targeting AVX512-VNNI");
  return x;
#endif
}
"""
