"""C++ source of the CPU paged decode-attention kernel (built by ``sparrow_cpu.native``).

Decode attention is memory-bound. The torch path gathers every request's blocks into a padded
copy and then reads the copy again, moving each cached key and value three times per layer and
step. This kernel walks the block table directly and reads each cached row once, with the query
heads of one KV head (GQA) sharing every load and an online softmax in fp32.

A sliding window ``W > 0`` starts the walk at the block holding key ``position - W + 1`` and skips
that block's earlier rows: blocks before the window (possibly freed and reused by the KV cache
manager) are never read. ``soft_cap > 0`` replaces each scaled score ``s`` with
``soft_cap * tanh(s / soft_cap)``. Zero turns either off.

The cache holds the query's dtype, or bfloat16 under float32 queries (``kv_cache_dtype="bfloat16"``:
half the bytes to read, each row widened to float32 as it is loaded).
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

template <typename scalar_t>
static inline float to_float(scalar_t v) { return static_cast<float>(v); }
// bfloat16 is float32's upper half: widen the bits (a shift the compiler vectorizes).
template <>
inline float to_float<at::BFloat16>(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for the softmax's x <= 0, in a form the compiler vectorizes: 2^(x log2 e) with a
// degree-6 polynomial for the fraction (relative error about 2e-7).
static inline float softmax_exp(float x) {
  const float t = std::max(x, -87.f) * 1.4426950408889634f;
  const float whole = std::floor(t), f = t - whole;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// query [T, Hq, D], kv_cache [2, NB, BS, Hkv, D], out [T, Hq, D] (same dtype as query)
// rows [N] int64: which query rows to compute; row_req [N] int64: their request index
// query_start_loc [R+1] int32, seq_lens [R] int32, block_table [R, MB] int32
// window > 0: attend to keys (position - window, position] only; soft_cap > 0: cap * tanh(s / cap).
// HEAD_DIM > 0 fixes the head size at compile time (unrolled loops); 0 reads it from the query.
template <typename scalar_t, typename cache_t, int64_t HEAD_DIM>
static void paged_attention_impl(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                                 const at::Tensor& rows, const at::Tensor& row_req,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 const at::Tensor& block_table, double scale, int64_t window,
                                 double soft_cap) {
  const int64_t num_rows = rows.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : query.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_ptr = kv_cache.data_ptr<cache_t>();
  const int64_t kv_stride = kv_cache.stride(0);  // keys -> values
  const cache_t* v_ptr = k_ptr + kv_stride;
  const int64_t block_stride = kv_cache.stride(1), row_stride = kv_cache.stride(2), head_stride = kv_cache.stride(3);
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t* rows_ptr = rows.data_ptr<int64_t>();
  const int64_t* req_ptr = row_req.data_ptr<int64_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(soft_cap), inv_cap = soft_cap > 0 ? 1.f / cap : 0.f;

  // Few rows: split each row's KV heads across items so every thread has work. Many rows: one
  // item per row, so a block's [block_size, Hkv, D] keys and values stream through contiguously.
  // Items are handed out one at a time (rows have different lengths), not in static ranges.
  const int64_t chunks = num_rows >= 8 ? 1 : num_kv_heads;
  const int64_t heads_per_item = num_kv_heads / chunks;
  const int64_t lanes = heads_per_item * group;  // query heads one item computes
  const int64_t num_items = num_rows * chunks;
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> q(lanes * head_dim), acc(lanes * head_dim), m(lanes), l(lanes);
    std::vector<float> scores(lanes * block_size);
    for (int64_t item = next_item.fetch_add(1); item < num_items; item = next_item.fetch_add(1)) {
      const int64_t n = item / chunks, h0 = (item % chunks) * heads_per_item;
      const int64_t t = rows_ptr[n], r = req_ptr[n];
      const int64_t query_len = qsl[r + 1] - qsl[r];
      const int64_t position = lens[r] - query_len + (t - qsl[r]);  // causal: attend to [0, position]
      const int64_t context = position + 1;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      for (int64_t lane = 0; lane < lanes; ++lane) {
        const scalar_t* src = q_ptr + (t * num_heads + h0 * group + lane) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[lane * head_dim + d] = to_float(src[d]) * fscale;
        m[lane] = -std::numeric_limits<float>::infinity();
        l[lane] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t num_blocks = std::min((context + block_size - 1) / block_size, max_blocks);
      for (int64_t j = first_key / block_size; j < num_blocks; ++j) {
        const int64_t block = table[r * max_blocks + j];
        if (chunks == 1 && j + 1 < num_blocks) {
          // Blocks are scattered: ask for the next one while this one is computed.
          const int64_t next = table[r * max_blocks + j + 1];
          const char* nk = reinterpret_cast<const char*>(k_ptr + next * block_stride);
          const char* nv = reinterpret_cast<const char*>(v_ptr + next * block_stride);
          for (int64_t offset = 0; offset < block_stride * (int64_t)sizeof(cache_t); offset += 64) {
            __builtin_prefetch(nk + offset);
            __builtin_prefetch(nv + offset);
          }
        }
        const int64_t valid = std::min(block_size, context - j * block_size);
        const int64_t skip = std::max<int64_t>(0, first_key - j * block_size);  // rows before the window
        const cache_t* kb = k_ptr + block * block_stride + h0 * head_stride;
        const cache_t* vb = v_ptr + block * block_stride + h0 * head_stride;
        for (int64_t s = skip; s < valid; ++s) {
          for (int64_t hh = 0; hh < heads_per_item; ++hh) {
            const cache_t* krow = kb + s * row_stride + hh * head_stride;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t lane = hh * group + g;
              const float* ql = q.data() + lane * head_dim;
              float dot = 0.f;
#pragma omp simd reduction(+:dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += ql[d] * to_float(krow[d]);
              scores[lane * block_size + s] = soft_cap > 0 ? cap * std::tanh(dot * inv_cap) : dot;
            }
          }
        }
        for (int64_t lane = 0; lane < lanes; ++lane) {
          float block_max = m[lane];
          float* sc = scores.data() + lane * block_size;
          for (int64_t s = skip; s < valid; ++s) block_max = std::max(block_max, sc[s]);
          if (block_max > m[lane]) {  // rescale only when the running max grows (rare after a few blocks)
            const float correction = softmax_exp(m[lane] - block_max);
            l[lane] *= correction;
            float* al = acc.data() + lane * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) al[d] *= correction;
            m[lane] = block_max;
          }
          float sum = 0.f;
#pragma omp simd reduction(+:sum)
          for (int64_t s = skip; s < valid; ++s) {
            sc[s] = softmax_exp(sc[s] - block_max);
            sum += sc[s];
          }
          l[lane] += sum;
        }
        for (int64_t s = skip; s < valid; ++s) {
          for (int64_t hh = 0; hh < heads_per_item; ++hh) {
            const cache_t* vrow = vb + s * row_stride + hh * head_stride;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t lane = hh * group + g;
              const float p = scores[lane * block_size + s];
              float* al = acc.data() + lane * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) al[d] += p * to_float(vrow[d]);
            }
          }
        }
      }
      for (int64_t lane = 0; lane < lanes; ++lane) {
        scalar_t* dst = o_ptr + (t * num_heads + h0 * group + lane) * head_dim;
        const float inv = l[lane] > 0.f ? 1.f / l[lane] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[lane * head_dim + d] * inv);
      }
    }
  });
}

void paged_attention(at::Tensor query, at::Tensor kv_cache, at::Tensor out, at::Tensor rows, at::Tensor row_req,
                     at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor block_table, double scale,
                     int64_t window, double soft_cap) {
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && out.is_contiguous(), "contiguous tensors expected");
#define SPARROW_PAGED_ATTENTION(T, C)                                                                \
  switch (query.size(2)) {                                                                          \
    case 64:                                                                                        \
      paged_attention_impl<T, C, 64>(query, kv_cache, out, rows, row_req, query_start_loc, seq_lens, \
                                     block_table, scale, window, soft_cap);                         \
      break;                                                                                        \
    case 128:                                                                                       \
      paged_attention_impl<T, C, 128>(query, kv_cache, out, rows, row_req, query_start_loc,         \
                                      seq_lens, block_table, scale, window, soft_cap);              \
      break;                                                                                        \
    default:                                                                                        \
      paged_attention_impl<T, C, 0>(query, kv_cache, out, rows, row_req, query_start_loc, seq_lens,  \
                                    block_table, scale, window, soft_cap);                          \
  }
  const auto q_type = query.scalar_type(), c_type = kv_cache.scalar_type();
  if (q_type == at::kFloat && c_type == at::kFloat) {
    SPARROW_PAGED_ATTENTION(float, float)
  } else if (q_type == at::kFloat && c_type == at::kBFloat16) {
    SPARROW_PAGED_ATTENTION(float, at::BFloat16)
  } else if (q_type == at::kBFloat16 && c_type == at::kBFloat16) {
    SPARROW_PAGED_ATTENTION(at::BFloat16, at::BFloat16)
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 or bfloat16 queries over a cache of their dtype, and "
                "float32 queries over a bfloat16 cache; got ", q_type, " over ", c_type);
  }
}
"""
