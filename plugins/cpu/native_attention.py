"""C++ source of the CPU paged decode-attention kernel (built by ``sparrow_cpu.native``).

Decode attention is memory-bound. The torch path gathers every request's blocks into a padded
copy and then reads the copy again, moving each cached key and value three times per layer and
step. This kernel walks the block table directly and reads each cached row once, with the query
heads of one KV head (GQA) sharing every load and an online softmax in fp32.

Per block and KV head, the group's query heads go in tiles of 4, 2 or 1 (tile sizes, and head
sizes 64 and 128, are fixed at compile time; other head sizes take a generic path). A tile takes
its dot products with VL key rows at a time (VL: floats per SIMD vector, 16 with AVX-512, 8 with
AVX, 4 otherwise), its queries in registers where they fit: each row leaves a vector of partial
sums, and a transpose-and-add tree folds the VL vectors pairwise as they come into one vector of
VL scores, instead of one horizontal sum per dot product. Their probabilities follow at once; the
softmax's reference max moves only for a score RESCALE above it (rarely: its rescaling branch is
predictable). The tile's output rows then stay in registers across the block's value rows; as it
reads each, it asks for that row's keys and values two blocks on (blocks are scattered) into the
outer caches. Vectors are GCC/Clang vector extensions: one source for every target.

A sliding window ``W > 0`` starts the walk at the block holding key ``position - W + 1`` and skips
that block's earlier rows: blocks before the window (possibly freed and reused by the KV cache
manager) are never read. ``soft_cap > 0`` replaces each scaled score ``s`` with
``soft_cap * tanh(s / soft_cap)``. Zero turns either off.

The cache holds the query's dtype, or bfloat16 under float32 queries (``kv_cache_dtype="bfloat16"``:
half the bytes to read, each row widened to float32 as it is loaded).
"""

from sparrow_cpu.native_simd import SOURCE as SIMD_SOURCE

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace sparrow_attention {

"""

SOURCE += SIMD_SOURCE + r"""
// Blocks are scattered: each value row read asks for the same key and value rows PREFETCH_BLOCKS
// blocks on, into the outer caches (locality 1; into L1 measured half the speed from DRAM).
constexpr int64_t PREFETCH_BLOCKS = 2;
template <typename cache_t>
inline void prefetch_row(const cache_t* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < dim * (int64_t)sizeof(cache_t); offset += 64) __builtin_prefetch(p + offset, 0, 1);
}


// The softmax's reference max moves only to a score this much above it (else probabilities up
// to e^8 are summed: the same result, and no rescaling or unpredictable branch per block).
constexpr float RESCALE = 8.f;

// Vectors of each output row a tile keeps in registers through the value rows.
template <int D, int TG>
constexpr int value_chunks() {
  int c = 1;
  while (D > 0 && 2 * c <= D / VL && 2 * c * TG <= REGS / 2) c *= 2;
  return c;
}

struct Rows {
  int64_t skip, valid, stride, dim;  // key rows [skip, valid) of the block, row stride, head size
  float cap, inv_cap;                // soft cap (0: off)
};

// One block of one KV head for TG query heads. q, acc: [TG, dim] (q scaled); m [TG]: reference
// maxima; l [TG, VL]: sums of probabilities (lane-wise); kb, vb: the head's first key and value
// row; nk, nv: the same two blocks on (or null); sc [TG, sc_stride]: scratch for probabilities.
template <int TG, int D, typename cache_t>
void attend_block(const float* q, float* acc, float* m, float* l, const cache_t* kb, const cache_t* vb,
                  const cache_t* nk, const cache_t* nv, const Rows& r, float* sc, int64_t sc_stride) {
  constexpr int NC = D / VL;
  constexpr bool QREGS = D > 0 && TG * NC <= REGS / 2;  // queries in registers, else read from L1
  const int64_t dim = D > 0 ? D : r.dim, nc = D > 0 ? NC : dim / VL;
  vfloat qv[TG][QREGS ? NC : 1];
  if constexpr (QREGS) {
    for (int g = 0; g < TG; ++g)
      for (int c = 0; c < NC; ++c) qv[g][c] = load(q + g * dim + c * VL);
  }
  // Scores, VL key rows at a time, each chunk's probabilities right after (online softmax).
  const int64_t first = r.skip - r.skip % VL;
  const vint row = iota(LANES), skip = splat_int(r.skip), valid = splat_int(r.valid);
  float correction[TG];
  vfloat sum[TG];
  for (int g = 0; g < TG; ++g) {
    correction[g] = 1.f;
    sum[g] = load(l + g * VL);
  }
  for (int64_t s0 = first; s0 < r.valid; s0 += VL) {
    // Partial sums of row s0 + i for each query head (zeros outside [skip, valid): not read).
    auto partials = [&](int i, vfloat* part) __attribute__((always_inline)) {
      const int64_t s = s0 + i;
      if (s < r.skip || s >= r.valid) {
        for (int g = 0; g < TG; ++g) part[g] = vfloat{};
        return;
      }
      const cache_t* krow = kb + s * r.stride;
      if constexpr (QREGS) {
        vfloat k[NC];
        for (int c = 0; c < NC; ++c) k[c] = load(krow + c * VL);
        for (int g = 0; g < TG; ++g) {
          vfloat a = qv[g][0] * k[0];
          for (int c = 1; c < NC; ++c) a += qv[g][c] * k[c];
          part[g] = a;
        }
      } else {
        for (int g = 0; g < TG; ++g) part[g] = vfloat{};
        for (int64_t c = 0; c < nc; ++c) {
          const vfloat k = load(krow + c * VL);
          for (int g = 0; g < TG; ++g) part[g] += load(q + g * dim + c * VL) * k;
        }
        for (int64_t d = nc * VL; d < dim; ++d)
          for (int g = 0; g < TG; ++g) part[g][0] += q[g * dim + d] * to_float(krow[d]);
      }
    };
    vfloat scores[TG];
    fold_tree<TG, LOG_VL, 0>(scores, partials);
    const vint s = row + static_cast<int32_t>(s0);
    const vint in = (s >= skip) & (s < valid);
    for (int g = 0; g < TG; ++g) {
      vfloat x = scores[g];
      if (r.cap > 0)
        for (int i = 0; i < VL; ++i) x[i] = r.cap * std::tanh(x[i] * r.inv_cap);
      x = select(in, x, splat(-1e30f));
      const float top = reduce<true>(x)[0];
      float* p = sc + g * sc_stride;
      if (top > m[g] + RESCALE) {  // move the reference max; rare after the first rows
        const float c = softmax_exp(splat(m[g] - top))[0];
        correction[g] *= c;
        sum[g] *= c;
        for (int64_t t = first; t < s0; t += VL) store(p + t, load(p + t) * c);
        m[g] = top;
      }
      const vfloat e = select(in, softmax_exp(x - m[g]), vfloat{});
      store(p + s0, e);
      sum[g] += e;
    }
  }
  for (int g = 0; g < TG; ++g) store(l + g * VL, sum[g]);
  // Values: TC vectors of each of the TG output rows in registers across the block's rows.
  constexpr int TC = value_chunks<D, TG>();
  for (int64_t c0 = 0; c0 + TC <= nc; c0 += TC) {
    vfloat a[TG][TC];
    for (int g = 0; g < TG; ++g)
      for (int c = 0; c < TC; ++c) a[g][c] = load(acc + g * dim + (c0 + c) * VL) * correction[g];
    for (int64_t s = r.skip; s < r.valid; ++s) {
      const cache_t* vrow = vb + s * r.stride + c0 * VL;
      // Here, in row order: from the scores' loop (bit-reversed order) it measured half as fast.
      if (nk != nullptr && c0 == 0) {
        prefetch_row(nk + s * r.stride, dim);
        prefetch_row(nv + s * r.stride, dim);
      }
      vfloat v[TC];
      for (int c = 0; c < TC; ++c) v[c] = load(vrow + c * VL);
      for (int g = 0; g < TG; ++g) {
        const vfloat p = splat(sc[g * sc_stride + s]);
        for (int c = 0; c < TC; ++c) a[g][c] += p * v[c];
      }
    }
    for (int g = 0; g < TG; ++g)
      for (int c = 0; c < TC; ++c) store(acc + g * dim + (c0 + c) * VL, a[g][c]);
  }
  for (int64_t d = nc * VL; d < dim; ++d) {  // a head size that is no multiple of VL
    for (int g = 0; g < TG; ++g) {
      float x = acc[g * dim + d] * correction[g];
      for (int64_t s = r.skip; s < r.valid; ++s) x += sc[g * sc_stride + s] * to_float(vb[s * r.stride + d]);
      acc[g * dim + d] = x;
    }
  }
}

// query [T, Hq, D], kv_cache [2, NB, BS, Hkv, D], out [T, Hq, D] (same dtype as query)
// rows [N] int64: which query rows to compute; row_req [N] int64: their request index
// query_start_loc [R+1] int32, seq_lens [R] int32, block_table [R, MB] int32
// window > 0: attend to keys (position - window, position] only; soft_cap > 0: cap * tanh(s / cap).
// HEAD_DIM > 0 fixes the head size at compile time (unrolled loops); 0 reads it from the query.
template <typename scalar_t, typename cache_t, int HEAD_DIM>
void paged_attention_impl(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                          const at::Tensor& rows, const at::Tensor& row_req, const at::Tensor& query_start_loc,
                          const at::Tensor& seq_lens, const at::Tensor& block_table, double scale, int64_t window,
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
  const int64_t block_stride = kv_cache.stride(1), head_stride = kv_cache.stride(3);
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t* rows_ptr = rows.data_ptr<int64_t>();
  const int64_t* req_ptr = row_req.data_ptr<int64_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  Rows shape{0, 0, kv_cache.stride(2), head_dim, static_cast<float>(soft_cap),
             soft_cap > 0 ? static_cast<float>(1.0 / soft_cap) : 0.f};
  const int64_t sc_stride = (block_size + VL - 1) / VL * VL;

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
    std::vector<float> q(lanes * head_dim), acc(lanes * head_dim), m(lanes), l(lanes * VL);
    std::vector<float> scores(4 * sc_stride);
    Rows r = shape;
    for (int64_t item = next_item.fetch_add(1); item < num_items; item = next_item.fetch_add(1)) {
      const int64_t n = item / chunks, h0 = (item % chunks) * heads_per_item;
      const int64_t t = rows_ptr[n], req = req_ptr[n];
      const int64_t query_len = qsl[req + 1] - qsl[req];
      const int64_t position = lens[req] - query_len + (t - qsl[req]);  // causal: attend to [0, position]
      const int64_t context = position + 1;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      for (int64_t lane = 0; lane < lanes; ++lane) {
        const scalar_t* src = q_ptr + (t * num_heads + h0 * group + lane) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[lane * head_dim + d] = to_float(src[d]) * fscale;
        m[lane] = -1e30f;  // below any score: the first one moves it
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* blocks = table + req * max_blocks;
      const int64_t num_blocks = std::min((context + block_size - 1) / block_size, max_blocks);
      for (int64_t j = first_key / block_size; j < num_blocks; ++j) {
        r.valid = std::min(block_size, context - j * block_size);
        r.skip = std::max<int64_t>(0, first_key - j * block_size);  // rows before the window
        const int64_t base = blocks[j] * block_stride + h0 * head_stride;
        const int64_t ahead = j + PREFETCH_BLOCKS;
        const int64_t next = ahead < num_blocks ? blocks[ahead] * block_stride + h0 * head_stride : -1;
        for (int64_t hh = 0; hh < heads_per_item; ++hh) {
          const cache_t* kb = k_ptr + base + hh * head_stride;
          const cache_t* vb = v_ptr + base + hh * head_stride;
          const cache_t* nk = next < 0 ? nullptr : k_ptr + next + hh * head_stride;
          const cache_t* nv = next < 0 ? nullptr : v_ptr + next + hh * head_stride;
          for (int64_t g = 0; g < group;) {  // tiles of 4, then 2 and 1 query heads
            const int64_t lane = hh * group + g, left = group - g;
            float* qa = q.data() + lane * head_dim;
            float* aa = acc.data() + lane * head_dim;
            float* ml = m.data() + lane;
            float* ll = l.data() + lane * VL;
            if (left >= 4) {
              attend_block<4, HEAD_DIM>(qa, aa, ml, ll, kb, vb, nk, nv, r, scores.data(), sc_stride);
              g += 4;
            } else if (left >= 2) {
              attend_block<2, HEAD_DIM>(qa, aa, ml, ll, kb, vb, nk, nv, r, scores.data(), sc_stride);
              g += 2;
            } else {
              attend_block<1, HEAD_DIM>(qa, aa, ml, ll, kb, vb, nk, nv, r, scores.data(), sc_stride);
              g += 1;
            }
            nk = nv = nullptr;  // one prefetch per row
          }
        }
      }
      for (int64_t lane = 0; lane < lanes; ++lane) {
        scalar_t* dst = o_ptr + (t * num_heads + h0 * group + lane) * head_dim;
        const float total = reduce<false>(load(l.data() + lane * VL))[0];
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[lane * head_dim + d] * inv);
      }
    }
  });
}

}  // namespace sparrow_attention

void paged_attention(at::Tensor query, at::Tensor kv_cache, at::Tensor out, at::Tensor rows, at::Tensor row_req,
                     at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor block_table, double scale,
                     int64_t window, double soft_cap) {
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && out.is_contiguous(), "contiguous tensors expected");
  // Head sizes 64 and 128 have their own (unrolled) kernels; others read it from the query.
#define SPARROW_PAGED_ATTENTION_DIMS(T, C)                                                               \
  (query.size(2) == 64    ? sparrow_attention::paged_attention_impl<T, C, 64>                            \
   : query.size(2) == 128 ? sparrow_attention::paged_attention_impl<T, C, 128>                           \
                          : sparrow_attention::paged_attention_impl<T, C, 0>)(                           \
      query, kv_cache, out, rows, row_req, query_start_loc, seq_lens, block_table, scale, window, soft_cap);
  const auto q_type = query.scalar_type(), c_type = kv_cache.scalar_type();
  if (q_type == at::kFloat && c_type == at::kFloat) {
    SPARROW_PAGED_ATTENTION_DIMS(float, float)
  } else if (q_type == at::kFloat && c_type == at::kBFloat16) {
    SPARROW_PAGED_ATTENTION_DIMS(float, at::BFloat16)
  } else if (q_type == at::kBFloat16 && c_type == at::kBFloat16) {
    SPARROW_PAGED_ATTENTION_DIMS(at::BFloat16, at::BFloat16)
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 or bfloat16 queries over a cache of their dtype, and "
                "float32 queries over a bfloat16 cache; got ", q_type, " over ", c_type);
  }
}
"""
