"""C++ SIMD helpers of the CPU attention kernel (``sparrow_cpu.native_attention`` puts them in its
namespace): float vectors of VL lanes as GCC/Clang vector extensions (16 with AVX-512, 8 with AVX,
4 otherwise: one source for every target), loads that widen bfloat16, the transpose-and-add tree
that folds VL rows' partial sums into one vector of scores, lane reductions, and a vectorized exp.
"""

SOURCE = r"""
// One SIMD register of floats (VL lanes); REGS vector registers. Any other target (SSE, NEON,
// none) gets 4-lane vectors, which the compiler splits or emulates where it has to.
#if defined(__AVX512F__)
constexpr int VL = 16, REGS = 32;
#elif defined(__AVX__)
constexpr int VL = 8, REGS = 16;
#else
constexpr int VL = 4, REGS = 16;
#endif
typedef float vfloat __attribute__((vector_size(4 * VL)));
typedef int32_t vint __attribute__((vector_size(4 * VL)));
typedef uint32_t vbits __attribute__((vector_size(4 * VL)));
typedef uint16_t vhalf __attribute__((vector_size(2 * VL)));

// bfloat16 is float32's upper half: widen the bits.
inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat load(const at::BFloat16* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof(h));
  const vbits bits = __builtin_convertvector(h, vbits) << 16;
  vfloat v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
inline vfloat splat(float x) { return vfloat{} + x; }

#if defined(__clang__)
#define SPARROW_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SPARROW_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vint{__VA_ARGS__})
#endif
constexpr auto LANES = std::make_integer_sequence<int, VL>();
constexpr int LOG_VL = VL == 16 ? 4 : VL == 8 ? 3 : 2;
template <int... I>
inline vint iota(std::integer_sequence<int, I...>) { return vint{I...}; }
inline vint splat_int(int64_t x) { return vint{} + static_cast<int32_t>(x); }
inline vfloat select(vint mask, vfloat a, vfloat b) { return mask ? a : b; }  // lane-wise
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// Transpose-and-add tree over VL partial-sum vectors, one per key row. The level with segments of
// SEG lanes folds a pair (a, b) into one vector: even segments keep a's lanes, odd ones b's, and
// each adds the lanes its row left SEG lanes away (in the other vector's place). Lanes are never
// moved back, so the rows come out in bit-reversed order: p[bit_reverse(s)] must hold row s.
constexpr int keep_lane(int seg, int i) { return (i / seg) % 2 == 0 ? i : VL + i; }
constexpr int swap_lane(int seg, int i) { return ((i ^ seg) / seg) % 2 == 1 ? (i ^ seg) : VL + (i ^ seg); }
constexpr int bit_reverse(int i) {
  int r = 0;
  for (int bit = 1; bit < VL; bit <<= 1, i >>= 1) r = (r << 1) | (i & 1);
  return r;
}
template <int SEG, int... I>
inline vfloat fold(vfloat a, vfloat b, std::integer_sequence<int, I...>) {
  return SPARROW_SHUFFLE(a, b, keep_lane(SEG, I)...) + SPARROW_SHUFFLE(a, b, swap_lane(SEG, I)...);
}
// Leaves [J, J + 2^LEVEL) of the tree for TG query heads, each row's partial sums (row(i, out):
// row i, out[TG]) folded as soon as its pair is there, so that few vectors are live at a time.
template <int TG, int LEVEL, int J, typename Row>
__attribute__((always_inline)) inline void fold_tree(vfloat* out, const Row& row) {
  if constexpr (LEVEL == 0) {
    row(bit_reverse(J), out);
  } else {
    vfloat a[TG], b[TG];
    fold_tree<TG, LEVEL - 1, J>(a, row);
    fold_tree<TG, LEVEL - 1, J + (1 << (LEVEL - 1))>(b, row);
    for (int g = 0; g < TG; ++g) out[g] = fold<(VL >> LEVEL)>(a[g], b[g], LANES);
  }
}
template <int SEG, int... I>
inline vfloat swap_segments(vfloat v, std::integer_sequence<int, I...>) {
  return SPARROW_SHUFFLE(v, v, (I ^ SEG)...);
}
// Every lane of the result holds the max (MAX) or the sum of v's lanes.
template <bool MAX, int SEG = VL / 2>
inline vfloat reduce(vfloat v) {
  if constexpr (SEG >= 1) {
    const vfloat w = swap_segments<SEG>(v, LANES);
    return reduce<MAX, SEG / 2>(MAX ? vmax(v, w) : v + w);
  }
  return v;
}

// exp(x) on every lane, for the softmax's x <= RESCALE: 2^(x log2 e) with a degree-6 polynomial
// for the fraction (relative error about 2e-7); floor as truncation, corrected where it rounded up.
inline vfloat softmax_exp(vfloat x) {
  const vfloat t = vmax(x, splat(-87.f)) * 1.4426950408889634f;
  vint whole = __builtin_convertvector(t, vint);
  whole += (vint)(__builtin_convertvector(whole, vfloat) > t);
  const vfloat f = t - __builtin_convertvector(whole, vfloat);
  vfloat p = splat(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  return p * (vfloat)((whole + 127) << 23);
}
"""
