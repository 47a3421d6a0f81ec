// attnlab's quantized matmul: y = x @ dequantize(w).T for GGML's Q4_0, Q4_1 and Q8_0 blocks, read as the file stores them.
//
// Why it exists: a decode step is a chain of matrix-vector products whose cost is the bytes of the
// weights. Kept in the file's 4.5-8.5 bits per weight, they are 4-7x fewer bytes than float32.
//
// Two routes over the same bytes:
// - the file's row order ("rows"): every weight is dequantized in registers exactly as the gguf package
//   (and llama.cpp's reference code) does: Q4_0 d * (q - 8), Q4_1 d * q + m (a multiply, then an add: no
//   FMA, so each weight is the same float32 as `gguf.quants.dequantize` gives), Q8_0 d * q. The
//   activations stay float32, summed 16 (AVX-512) or 8 (AVX2) lanes at a time, so the result differs
//   from `x @ W_fp32.T` only by the order of the float32 additions.
// - tiles of 16 interleaved rows ("tiles", what quantized models use): llama.cpp's route, int8
//   activations and exact integer block sums (see "the tiled layout" below), on AVX-512 VNNI, AVX2 or
//   plain C++, which give the same floats bit for bit.
//
// The ISA is chosen at run time (__builtin_cpu_supports), so one build runs on any x86-64. The library
// is compiled without -march.
//
// Block layouts (ggml-common.h), 32 weights of one row per block:
//   Q4_0: fp16 d, 16 bytes: weight j in the low nibble of byte j, weight j + 16 in its high nibble   18 bytes
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles as Q4_0                                                 20 bytes
//   Q8_0: fp16 d, 32 int8                                                                             34 bytes

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // GGML's type ids

int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: TORCH_CHECK(false, "attnlab quant: unknown block kind ", kind, " (expected 2 = Q4_0, 3 = Q4_1, 8 = Q8_0)");
  }
  return 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// ---- plain C++: the reference every vector path must equal (tests compare them) -------------------

template <int64_t K>
void decode_scalar(const uint8_t* b, float* out) {
  if constexpr (K == Q8_0) {
    const float d = half_at(b);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  } else if constexpr (K == Q4_0) {
    const float d = half_at(b);
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>((b[2 + j] & 0xF) - 8);
      out[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
    }
  } else {
    const float d = half_at(b), m = half_at(b + 2);
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(b[4 + j] & 0xF) + m;
      out[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
    }
  }
}

template <int64_t K, int M>
void rows_scalar(const uint8_t* w, int64_t nb, const float* x, int64_t ldx, const float*, float* y, int64_t ldy,
                 int64_t n0, int64_t n1) {
  constexpr int64_t BB = K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34;
  float wf[32];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * BB;
    float acc[M] = {};
    for (int64_t b = 0; b < nb; ++b) {
      decode_scalar<K>(row + b * BB, wf);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * ldx + b * kBlock;
        for (int j = 0; j < 32; ++j) acc[m] += wf[j] * xb[j];
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = acc[m];
  }
}

// F16C: one instruction per scale (c10::Half's portable conversion is ~20)
__attribute__((target("f16c"))) inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ---- AVX-512: a block is two 16-float vectors -----------------------------------------------------

#define ATTNLAB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

template <int64_t K>
ATTNLAB_AVX512 inline void decode_avx512(const uint8_t* b, __m512& w0, __m512& w1) {
  if constexpr (K == Q8_0) {
    const __m512 d = _mm512_set1_ps(half_f16c(b));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))), d);
  } else {
    const int off = K == Q4_1 ? 4 : 2;
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + off)));
    __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(0xF));
    __m512i hi = _mm512_srli_epi32(q, 4);
    const __m512 d = _mm512_set1_ps(half_f16c(b));
    if constexpr (K == Q4_0) {
      lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
      hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
      w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo));
      w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi));
    } else {
      const __m512 m = _mm512_set1_ps(half_f16c(b + 2));
      w0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m);
      w1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m);
    }
  }
}

// The block's integer values as floats (Q4: 0..15, Q8_0: -128..127); the scale and offset are applied per block:
//   sum_j w_j x_j = d * sum_j q_j x_j + c * sum_j x_j,   c = m (Q4_1), -8 d (Q4_0), 0 (Q8_0),
// with sum_j x_j precomputed once per block of x (xs). Three fewer vector operations per block than
// dequantizing each weight; the sums differ from x @ W.T only by float32 rounding.
template <int64_t K>
ATTNLAB_AVX512 inline void ints_avx512(const uint8_t* b, __m512& lo, __m512& hi) {
  if constexpr (K == Q8_0) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18))));
  } else {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + (K == Q4_1 ? 4 : 2))));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xF)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
  }
}

template <int64_t K>
ATTNLAB_AVX512 inline float offset_of(const uint8_t* b, float d) {
  if constexpr (K == Q4_1) return half_f16c(b + 2);
  if constexpr (K == Q4_0) return -8.0f * d;
  return 0.0f;
}

// R weight rows per pass (each x vector loaded once serves them), M rows of x (M <= 8).
template <int64_t K, int M, int R>
ATTNLAB_AVX512 inline void rows_pass_avx512(const uint8_t* r0, int64_t rb, int64_t nb, const float* x, int64_t ldx,
                                            const float* xs, float* y, int64_t ldy, int64_t n) {
  constexpr int64_t BB = K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34;
  __m512 acc[R][M];
  float off[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps(), off[r][m] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 lo[R], hi[R], d[R];
    float c[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = r0 + r * rb + b * BB;
      _mm_prefetch((const char*)(blk + 8 * BB), _MM_HINT_T0);
      ints_avx512<K>(blk, lo[r], hi[r]);
      const float ds = half_f16c(blk);
      d[r] = _mm512_set1_ps(ds);
      c[r] = offset_of<K>(blk, ds);
    }
    for (int m = 0; m < M; ++m) {
      const float* xb = x + m * ldx + b * kBlock;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_fmadd_ps(hi[r], x1, _mm512_mul_ps(lo[r], x0));
        acc[r][m] = _mm512_fmadd_ps(t, d[r], acc[r][m]);
        if constexpr (K != Q8_0) off[r][m] += c[r] * xs[m * nb + b];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) y[m * ldy + n + r] = _mm512_reduce_add_ps(acc[r][m]) + off[r][m];
}

template <int64_t K, int M>
ATTNLAB_AVX512 void rows_avx512(const uint8_t* w, int64_t nb, const float* x, int64_t ldx, const float* xs, float* y,
                                int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t BB = K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34;
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;  // accumulators R * M <= 8 zmm
  const int64_t rb = nb * BB;
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows_pass_avx512<K, M, R>(w + n * rb, rb, nb, x, ldx, xs, y, ldy, n);
  for (; n < n1; ++n) rows_pass_avx512<K, M, 1>(w + n * rb, rb, nb, x, ldx, xs, y, ldy, n);
}

template <int64_t K>
ATTNLAB_AVX512 void dequant_avx512(const uint8_t* w, int64_t blocks, float* out) {
  constexpr int64_t BB = K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 u0, u1;
    decode_avx512<K>(w + b * BB, u0, u1);
    _mm512_storeu_ps(out + b * kBlock, u0);
    _mm512_storeu_ps(out + b * kBlock + 16, u1);
  }
}

// ---- AVX2: a block is four 8-float vectors --------------------------------------------------------

#define ATTNLAB_AVX2 __attribute__((target("avx2,fma,f16c")))

ATTNLAB_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int64_t K>
ATTNLAB_AVX2 inline void decode_avx2(const uint8_t* b, __m256 (&v)[4]) {
  const __m256 d = _mm256_set1_ps(half_f16c(b));
  if constexpr (K == Q8_0) {
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * i)))), d);
  } else {
    const int off = K == Q4_1 ? 4 : 2;
    const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + off)));      // bytes 0-7
    const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + off + 8)));  // bytes 8-15
    const __m256i mask = _mm256_set1_epi32(0xF);
    __m256i q[4] = {_mm256_and_si256(q0, mask), _mm256_and_si256(q1, mask), _mm256_srli_epi32(q0, 4),
                    _mm256_srli_epi32(q1, 4)};  // weights 0-7, 8-15, 16-23, 24-31
    if constexpr (K == Q4_0) {
      for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], _mm256_set1_epi32(8))));
    } else {
      const __m256 m = _mm256_set1_ps(half_f16c(b + 2));
      for (int i = 0; i < 4; ++i) v[i] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q[i])), m);
    }
  }
}

template <int64_t K, int M>
ATTNLAB_AVX2 void rows_avx2(const uint8_t* w, int64_t nb, const float* x, int64_t ldx, const float*, float* y,
                            int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t BB = K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * BB;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 v[4];
      decode_avx2<K>(row + b * BB, v);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * ldx + b * kBlock;
        for (int i = 0; i < 4; ++i) acc[m] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xb + 8 * i), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = hsum256(acc[m]);
  }
}

template <int64_t K>
ATTNLAB_AVX2 void dequant_avx2(const uint8_t* w, int64_t blocks, float* out) {
  constexpr int64_t BB = K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    decode_avx2<K>(w + b * BB, v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * kBlock + 8 * i, v[i]);
  }
}

template <int64_t K>
void dequant_scalar(const uint8_t* w, int64_t blocks, float* out) {
  constexpr int64_t BB = K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34;
  for (int64_t b = 0; b < blocks; ++b) decode_scalar<K>(w + b * BB, out + b * kBlock);
}

// ---- dispatch ----------------------------------------------------------------------------------------

// VNNI_Q8 is AVX-512 with an int8 cache's keys multiplied by the query rounded to int8 (scores_q8_vnni): the
// default of decode_attention and of llama_decode on a CPU with AVX-512 VNNI; cpu_isa() stays the best exact one.
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2, VNNI_Q8 = 3 };

int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;  // F16C comes with every AVX2 CPU
  return SCALAR;
}

using RowsFn = void (*)(const uint8_t*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t);

template <int64_t K, int M>
RowsFn rows_for(int64_t isa) {
  if (isa == AVX512) return rows_avx512<K, M>;
  if (isa == AVX2) return rows_avx2<K, M>;
  return rows_scalar<K, M>;
}

template <int64_t K>
RowsFn rows_for_m(int64_t isa, int64_t m) {
  switch (m) {
    case 1: return rows_for<K, 1>(isa);
    case 2: return rows_for<K, 2>(isa);
    case 3: return rows_for<K, 3>(isa);
    case 4: return rows_for<K, 4>(isa);
    case 5: return rows_for<K, 5>(isa);
    case 6: return rows_for<K, 6>(isa);
    case 7: return rows_for<K, 7>(isa);
    default: return rows_for<K, 8>(isa);
  }
}

RowsFn pick_rows(int64_t kind, int64_t isa, int64_t m) {
  if (kind == Q4_0) return rows_for_m<Q4_0>(isa, m);
  if (kind == Q4_1) return rows_for_m<Q4_1>(isa, m);
  return rows_for_m<Q8_0>(isa, m);
}

int64_t resolve_isa(int64_t isa) {
  const int64_t best = best_isa();
  if (isa < 0) return best;
  TORCH_CHECK(isa <= best, "attnlab quant: isa=", isa, " was asked for, but this CPU offers at most ", best,
              " (0 = plain C++, 1 = AVX2, 2 = AVX-512)");
  return isa;
}

bool has_vnni();

void check_weight(const at::Tensor& w, int64_t kind, int64_t in_features) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "attnlab quant: w must be a contiguous 2-D uint8 CPU tensor of GGML blocks, got ", w.scalar_type(), " of ",
              w.sizes(), " on ", w.device());
  TORCH_CHECK(in_features > 0 && in_features % kBlock == 0, "attnlab quant: in_features=", in_features,
              " must be a positive multiple of 32 (the GGML block)");
  TORCH_CHECK(w.size(1) == in_features / kBlock * block_bytes(kind), "attnlab quant: w has ", w.size(1),
              " bytes per row, expected ", in_features / kBlock * block_bytes(kind), " for ", in_features, " inputs");
}

// y (M, N) = x (M, K) @ dequantize(w (N, K/32 blocks)).T, float32.
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t in_features, int64_t isa) {
  check_weight(w, kind, in_features);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == in_features,
              "attnlab quant: x must be a 2-D float32 CPU tensor with ", in_features, " columns, got ", x.scalar_type(),
              " of ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), N = w.size(0), nb = in_features / kBlock;
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const int64_t level = resolve_isa(isa);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // sum of x over each block, for the per-block offset: only the AVX-512 rows read it (see ints_avx512)
  const at::Tensor xs = level == AVX512 ? xc.view({M, nb, kBlock}).sum(-1).contiguous() : at::Tensor();
  const float* xsp = xs.defined() ? xs.data_ptr<float>() : nullptr;
  // up to 8 rows of x share one pass over the weights; a larger M takes passes of 8
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t mc = std::min<int64_t>(8, M - m0);
    const RowsFn fn = pick_rows(kind, level, mc);
    const float* xm = xp + m0 * in_features;
    const float* xsm = xsp + m0 * nb;
    float* ym = yp + m0 * N;
    at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) { fn(wp, nb, xm, in_features, xsm, ym, N, n0, n1); });
  }
  return y;
}

// (N, K) float32 weights, as gguf.quants.dequantize gives them.
at::Tensor dequantize(const at::Tensor& w, int64_t kind, int64_t in_features, int64_t isa) {
  check_weight(w, kind, in_features);
  const int64_t N = w.size(0), nb = in_features / kBlock, bb = block_bytes(kind);
  at::Tensor out = at::empty({N, in_features}, at::TensorOptions().dtype(at::kFloat));
  if (N == 0) return out;
  const int64_t level = resolve_isa(isa);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    const uint8_t* src = wp + n0 * nb * bb;
    float* dst = op + n0 * in_features;
    const int64_t blocks = (n1 - n0) * nb;
    if (kind == Q4_0) {
      level == AVX512 ? dequant_avx512<Q4_0>(src, blocks, dst) : level == AVX2 ? dequant_avx2<Q4_0>(src, blocks, dst) : dequant_scalar<Q4_0>(src, blocks, dst);
    } else if (kind == Q4_1) {
      level == AVX512 ? dequant_avx512<Q4_1>(src, blocks, dst) : level == AVX2 ? dequant_avx2<Q4_1>(src, blocks, dst) : dequant_scalar<Q4_1>(src, blocks, dst);
    } else {
      level == AVX512 ? dequant_avx512<Q8_0>(src, blocks, dst) : level == AVX2 ? dequant_avx2<Q8_0>(src, blocks, dst) : dequant_scalar<Q8_0>(src, blocks, dst);
    }
  });
  return out;
}

int64_t cpu_isa() { return best_isa(); }

// ==== the tiled layout and its int8 kernels (AVX-512 VNNI, AVX2, plain C++) ==========================
//
// llama.cpp's own CPU route, in attnlab's words: the activations are quantized to int8, one scale per
// block of 32 (dx = max|x| / 127, q = round(x / dx)), and each block's dot product is an exact
// integer sum (vpdpbusd: u8 x s8 -> s32, four pairs per lane), scaled once per block:
//   Q4_1: sum_j (d q_j + m) x_j  ~=  d dx sum_j q_j xq_j + m dx sum_j xq_j
//   Q4_0: d dx (sum_j q_j xq_j - 8 sum_j xq_j)
//   Q8_0: d dx (sum_j (q_j + 128) xq_j - 128 sum_j xq_j)                   (vpdpbusd wants u8 weights)
// that is, exactly the dot product of the file's weights with the rounded x (dx xq_j), up to float32
// rounding: |x_j - dx xq_j| <= dx / 2 is the only approximation (tests hold each product to its bound).
// (Using the exact float sum of x for the offset instead measured 2-3x *worse* on SmolLM2's
// activations: Q4_1's q_j are 0..15, all of one sign, so their rounding errors do not cancel.)
//
// For one vpdpbusd to serve 16 weight rows, rows are interleaved in tiles of 16 (a layout of the same
// bytes as the file's; rows padded to a multiple of 16 with zeros). Per tile, per block b:
//   Q4_0: d[16] fp16 | qs[4][16][4]                (group g holds bytes 4g..4g+3 of each row's 16)    288 B
//   Q4_1: d[16] fp16 | m[16] fp16 | qs[4][16][4]                                                      320 B
//   Q8_0: d[16] fp16 | qs[8][16][4], bytes XOR 0x80 (q + 128 as u8)                                  544 B
// Lane r of a 64-byte group is row r's 4 bytes; the activations' 4 matching int8s are broadcast.

constexpr int64_t kTile = 16;
// A tiled matmul of fewer block-tiles (tiles x blocks per row) than this runs on one thread: waking the
// second costs more than it saves there (SmolLM2's Q|K|V, out and down projections are below it).
constexpr int64_t kSerialBlockTiles = 2048;

int64_t scales_bytes(int64_t kind) { return kind == Q4_1 ? 64 : 32; }

// (N, row bytes) row-major blocks -> tiled, (ceil(N / 16) * 16, row bytes)
at::Tensor repack_tiles(const at::Tensor& w, int64_t kind, int64_t in_features) {
  check_weight(w, kind, in_features);
  const int64_t N = w.size(0), nb = in_features / kBlock, bb = block_bytes(kind), rb = nb * bb;
  const int64_t tiles = (N + kTile - 1) / kTile;
  at::Tensor out = at::zeros({tiles * kTile, rb}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t qoff = kind == Q4_1 ? 4 : 2, qbytes = kind == Q8_0 ? 32 : 16, sb = scales_bytes(kind);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* tile = dst + (t * nb + b) * kTile * bb;
        for (int64_t r = 0; r < kTile; ++r) {
          const int64_t n = t * kTile + r;
          if (n >= N) {  // padding rows: zero scales, and for Q8_0 the bytes of q = 0
            if (kind == Q8_0)
              for (int64_t g = 0; g < qbytes / 4; ++g) std::memset(tile + sb + g * 64 + r * 4, 0x80, 4);
            continue;
          }
          const uint8_t* blk = src + n * rb + b * bb;
          std::memcpy(tile + 2 * r, blk, 2);                            // d
          if (kind == Q4_1) std::memcpy(tile + 32 + 2 * r, blk + 2, 2);  // m
          for (int64_t g = 0; g < qbytes / 4; ++g)
            for (int64_t k = 0; k < 4; ++k) {
              const uint8_t q = blk[qoff + 4 * g + k];
              tile[sb + g * 64 + r * 4 + k] = kind == Q8_0 ? static_cast<uint8_t>(q ^ 0x80) : q;
            }
        }
      }
    }
  });
  return out;
}

// Row n of a tiled tensor, dequantized into out[0 .. in_features) (the same floats as the row layout gives).
void dequant_tiled_row(const uint8_t* w, int64_t kind, int64_t nb, int64_t n, float* out) {
  const int64_t bb = block_bytes(kind), t = n / kTile, r = n % kTile, sb = scales_bytes(kind);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = w + (t * nb + b) * kTile * bb;
    uint8_t blk[34];
    std::memcpy(blk, tile + 2 * r, 2);
    if (kind == Q4_1) std::memcpy(blk + 2, tile + 32 + 2 * r, 2);
    const int64_t qoff = kind == Q4_1 ? 4 : 2, groups = kind == Q8_0 ? 8 : 4;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t k = 0; k < 4; ++k) {
        const uint8_t q = tile[sb + g * 64 + r * 4 + k];
        blk[qoff + 4 * g + k] = kind == Q8_0 ? static_cast<uint8_t>(q ^ 0x80) : q;
      }
    if (kind == Q4_0) decode_scalar<Q4_0>(blk, out + b * kBlock);
    else if (kind == Q4_1) decode_scalar<Q4_1>(blk, out + b * kBlock);
    else decode_scalar<Q8_0>(blk, out + b * kBlock);
  }
}

// rows (R,) int64 of a tiled (N, row bytes) tensor -> (R, in_features) float32; rows = None: every row < out_rows
at::Tensor dequantize_tiles(const at::Tensor& w, int64_t kind, int64_t in_features, const at::Tensor& rows) {
  check_weight(w, kind, in_features);
  TORCH_CHECK(w.size(0) % kTile == 0, "attnlab quant: a tiled tensor has a multiple of 16 rows, got ", w.size(0));
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "attnlab quant: rows must be a 1-D int64 tensor");
  const at::Tensor rc = rows.contiguous();
  const int64_t R = rc.size(0), nb = in_features / kBlock;
  at::Tensor out = at::empty({R, in_features}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* rp = rc.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < w.size(0), "attnlab quant: row ", rp[i], " out of range 0 .. ", w.size(0) - 1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequant_tiled_row(wp, kind, nb, rp[i], op + i * in_features);
  });
  return out;
}

struct QuantizedX {
  const int8_t* q;    // (K,) int8
  const float* dx;    // (nb,) scale per block
  const int32_t* qs;  // (nb,) sum of q per block
};

// x rounded to int8 per block of 32: dx = max|x| / 127, q = round-half-even(x / dx), |q| <= 127.
void quantize_row_scalar(const float* x, int64_t nb, int8_t* q, float* dx, int32_t* qs) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t qsum = 0;
    for (int j = 0; j < 32; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
      q[b * kBlock + j] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
      qsum += q[b * kBlock + j];
    }
    dx[b] = d;
    qs[b] = qsum;
  }
}

// The same rounding, 8 lanes at a time (the same bytes as quantize_row_scalar: tests compare them).
ATTNLAB_AVX2 void quantize_row_avx2(const float* x, int64_t nb, int8_t* q, float* dx, int32_t* qs) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                              _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      n[i] = _mm256_max_epi32(nlim, _mm256_min_epi32(lim, _mm256_cvtps_epi32(r)));
    }
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    // packs interleave the two 128-bit lanes; the permute puts the 32 bytes back in order
    const __m256i w16 = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(q + b * kBlock), ordered);
    dx[b] = d;
    qs[b] = _mm_cvtsi128_si32(t4);
  }
}

#define ATTNLAB_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

template <int64_t K, int M>
ATTNLAB_VNNI void tiles_vnni(const uint8_t* w, int64_t nb, const QuantizedX* xq, float* y, int64_t ldy, int64_t t0,
                             int64_t t1) {
  constexpr int64_t TB = kTile * (K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34);  // bytes of one block-tile
  constexpr int64_t SB = K == Q4_1 ? 64 : 32;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* p = w + t * nb * TB;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = p + b * TB;
      _mm_prefetch((const char*)(blk + 4 * TB), _MM_HINT_T0);
      _mm_prefetch((const char*)(blk + 4 * TB + 64), _MM_HINT_T0);
      _mm_prefetch((const char*)(blk + 4 * TB + 128), _MM_HINT_T0);
      _mm_prefetch((const char*)(blk + 4 * TB + 192), _MM_HINT_T0);
      _mm_prefetch((const char*)(blk + 4 * TB + 256), _MM_HINT_T0);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
      if constexpr (K == Q8_0) {
        __m512i wq[8];
        for (int g = 0; g < 8; ++g) wq[g] = _mm512_loadu_si512((const void*)(blk + SB + 64 * g));
        if constexpr (true) {
          _mm_prefetch((const char*)(blk + 4 * TB + 320), _MM_HINT_T0);
          _mm_prefetch((const char*)(blk + 4 * TB + 384), _MM_HINT_T0);
          _mm_prefetch((const char*)(blk + 4 * TB + 448), _MM_HINT_T0);
          _mm_prefetch((const char*)(blk + 4 * TB + 512), _MM_HINT_T0);
        }
        for (int m = 0; m < M; ++m) {
          const int32_t* xb = (const int32_t*)(xq[m].q + b * kBlock);
          __m512i s = _mm512_set1_epi32(-128 * xq[m].qs[b]);
          for (int g = 0; g < 8; ++g) s = _mm512_dpbusd_epi32(s, wq[g], _mm512_set1_epi32(xb[g]));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xq[m].dx[b])), acc[m]);
        }
      } else {
        __m512i lo[4], hi[4];
        for (int g = 0; g < 4; ++g) {
          const __m512i v = _mm512_loadu_si512((const void*)(blk + SB + 64 * g));
          lo[g] = _mm512_and_si512(v, low4);
          hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        __m512 mv = _mm512_setzero_ps();
        if constexpr (K == Q4_1) mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)));
        for (int m = 0; m < M; ++m) {
          const int32_t* xb = (const int32_t*)(xq[m].q + b * kBlock);
          __m512i s = K == Q4_0 ? _mm512_set1_epi32(-8 * xq[m].qs[b]) : _mm512_setzero_si512();
          for (int g = 0; g < 4; ++g) {
            s = _mm512_dpbusd_epi32(s, lo[g], _mm512_set1_epi32(xb[g]));
            s = _mm512_dpbusd_epi32(s, hi[g], _mm512_set1_epi32(xb[4 + g]));
          }
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xq[m].dx[b])), acc[m]);
          if constexpr (K == Q4_1)  // m times the sum of the rounded x: dx * sum q
            acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xq[m].dx[b] * static_cast<float>(xq[m].qs[b])), acc[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * ldy + t * kTile, acc[m]);
  }
}

// The same tiles and the same integer sums with AVX2 (Intel Haswell and later, AMD Zen 1-3: no VNNI).
// A 64-byte group (16 rows x 4 bytes) is two 32-byte halves, rows 0-7 and 8-15. vpmaddubsw multiplies
// u8 by s8 and adds pairs into int16, vpmaddwd(., 1) adds those pairs into int32: 4 products per row.
//   Q4: nibbles 0..15 times |xq| <= 127: a pair is at most 3810, so the 8 groups of a block add up in
//       int16 (<= 30480) before one widening.
//   Q8_0: signed q times signed xq: |q| as u8 against xq * sign(q) (vpsignb), a pair at most 32512,
//       widened per group. The tiles hold q + 128 (for VNNI), so the sign bit is flipped back first.
// Every block's integer sum is exact and scaled exactly as tiles_vnni scales it, so the two kernels
// give the same floats bit for bit (tests compare them, and the plain C++ tiles_scalar).
template <int64_t K, int M>
ATTNLAB_AVX2 void tiles_avx2(const uint8_t* w, int64_t nb, const QuantizedX* xq, float* y, int64_t ldy, int64_t t0,
                             int64_t t1) {
  constexpr int64_t TB = kTile * (K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34);
  constexpr int64_t SB = K == Q4_1 ? 64 : 32;
  constexpr int groups = K == Q8_0 ? 8 : 4;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* p = w + t * nb * TB;
    // With several rows of x: rows 0-7 over every block, then rows 8-15, so that one half's accumulators
    // fit the 16 registers (both halves' spilled with 4 rows of x: 10.5 -> 9.5 ns per block-tile and row
    // for Q4_1, 15.4 -> 10.8 for Q8_0, AMD EPYC); the second half reads the tile again from L1 (<= 16 KiB).
    // With one row both halves go together: one pass over the tile.
    constexpr int passes = M > 1 ? 2 : 1;
    for (int hp = 0; hp < passes; ++hp) {
      const int h0 = passes == 2 ? hp : 0, h1 = passes == 2 ? hp + 1 : 2;
      __m256 acc[2][M];
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < M; ++m) acc[h][m] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = p + b * TB;
        if (hp == 0)
          for (int64_t line = 0; line < TB; line += 64) _mm_prefetch((const char*)(blk + 4 * TB + line), _MM_HINT_T0);
        for (int h = h0; h < h1; ++h) {
          __m256i s[M];  // Q4: int16 pair sums over the block; Q8_0: int32 sums
          for (int m = 0; m < M; ++m) s[m] = _mm256_setzero_si256();
          for (int g = 0; g < groups; ++g) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + SB + 64 * g + 32 * h));
            if constexpr (K == Q8_0) {
              const __m256i wq = _mm256_xor_si256(v, flip), wa = _mm256_abs_epi8(wq);
              for (int m = 0; m < M; ++m) {
                const __m256i bx = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(xq[m].q + b * kBlock)[g]);
                s[m] = _mm256_add_epi32(s[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(bx, wq)), ones));
              }
            } else {
              const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
              for (int m = 0; m < M; ++m) {
                const int32_t* xb = reinterpret_cast<const int32_t*>(xq[m].q + b * kBlock);
                s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xb[g])));
                s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xb[4 + g])));
              }
            }
          }
          const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * h)));
          __m256 mv = _mm256_setzero_ps();
          if constexpr (K == Q4_1) mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 32 + 16 * h)));
          for (int m = 0; m < M; ++m) {
            __m256i si = K == Q8_0 ? s[m] : _mm256_madd_epi16(s[m], ones);
            if constexpr (K == Q4_0) si = _mm256_add_epi32(si, _mm256_set1_epi32(-8 * xq[m].qs[b]));
            acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(d, _mm256_set1_ps(xq[m].dx[b])), acc[h][m]);
            if constexpr (K == Q4_1)
              acc[h][m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xq[m].dx[b] * static_cast<float>(xq[m].qs[b])), acc[h][m]);
          }
        }
      }
      for (int h = h0; h < h1; ++h)
        for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + m * ldy + t * kTile + 8 * h, acc[h][m]);
    }
  }
}

// Plain C++: the reference for both vector kernels (the same integer sums, the same fused multiply-adds).
template <int64_t K, int M>
void tiles_scalar(const uint8_t* w, int64_t nb, const QuantizedX* xq, float* y, int64_t ldy, int64_t t0, int64_t t1) {
  constexpr int64_t TB = kTile * (K == Q4_0 ? 18 : K == Q4_1 ? 20 : 34);
  constexpr int64_t SB = K == Q4_1 ? 64 : 32;
  constexpr int groups = K == Q8_0 ? 8 : 4;
  for (int64_t t = t0; t < t1; ++t) {
    float acc[M][kTile] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + (t * nb + b) * TB;
      for (int64_t r = 0; r < kTile; ++r) {
        const float d = half_at(blk + 2 * r);
        const float mval = K == Q4_1 ? half_at(blk + 32 + 2 * r) : 0.0f;
        for (int m = 0; m < M; ++m) {
          const int8_t* xb = xq[m].q + b * kBlock;
          int32_t s = K == Q4_0 ? -8 * xq[m].qs[b] : 0;
          for (int g = 0; g < groups; ++g)
            for (int k = 0; k < 4; ++k) {
              const uint8_t byte = blk[SB + 64 * g + 4 * r + k];
              if constexpr (K == Q8_0) {
                s += static_cast<int8_t>(byte ^ 0x80) * xb[4 * g + k];
              } else {
                s += (byte & 0xF) * xb[4 * g + k] + (byte >> 4) * xb[16 + 4 * g + k];
              }
            }
          const float dx = xq[m].dx[b];
          acc[m][r] = std::fma(static_cast<float>(s), d * dx, acc[m][r]);
          if constexpr (K == Q4_1) acc[m][r] = std::fma(mval, dx * static_cast<float>(xq[m].qs[b]), acc[m][r]);
        }
      }
    }
    for (int m = 0; m < M; ++m) std::memcpy(y + m * ldy + t * kTile, acc[m], sizeof(acc[m]));
  }
}

bool has_vnni() {
  __builtin_cpu_init();
  return best_isa() == AVX512 && __builtin_cpu_supports("avx512vnni");
}

// The tiled kernel's instruction sets: 0 plain C++, 1 AVX2, 2 AVX-512 VNNI (an AVX-512 CPU without VNNI runs AVX2).
enum TileIsa : int64_t { TILES_SCALAR = 0, TILES_AVX2 = 1, TILES_VNNI = 2 };

int64_t best_tile_isa() {
  if (has_vnni()) return TILES_VNNI;
  return best_isa() >= AVX2 ? TILES_AVX2 : TILES_SCALAR;
}

int64_t resolve_tile_isa(int64_t isa) {
  const int64_t best = best_tile_isa();
  if (isa < 0) return best;
  TORCH_CHECK(isa <= best, "attnlab quant: tiles isa=", isa, " was asked for, but this CPU offers at most ", best,
              " (0 = plain C++, 1 = AVX2, 2 = AVX-512 VNNI)");
  return isa;
}

using TilesFn = void (*)(const uint8_t*, int64_t, const QuantizedX*, float*, int64_t, int64_t, int64_t);

template <int64_t K, int M>
TilesFn tiles_on(int64_t isa) {
  if (isa == TILES_VNNI) return tiles_vnni<K, M>;
  if (isa == TILES_AVX2) return tiles_avx2<K, M>;
  return tiles_scalar<K, M>;
}

template <int64_t K>
TilesFn tiles_for(int64_t isa, int64_t m) {
  switch (m) {
    case 1: return tiles_on<K, 1>(isa);
    case 2: return tiles_on<K, 2>(isa);
    case 3: return tiles_on<K, 3>(isa);
    default: return tiles_on<K, 4>(isa);
  }
}

// Rows of x rounded to int8 (quantize_row_*), kept for the matmuls that read them.
struct QuantBuf {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> qs;
  std::vector<QuantizedX> rows;
  int64_t K = 0;

  QuantBuf(int64_t B, int64_t K_)
      : q(B * K_), dx(B * K_ / kBlock), qs(B * K_ / kBlock), rows(B), K(K_) {
    const int64_t nb = K / kBlock;
    for (int64_t b = 0; b < B; ++b)
      rows[b] = {q.data() + b * K, dx.data() + b * nb, qs.data() + b * nb};
  }

  // blocks [b0, b1) of row r of x (K floats per row); each block is rounded on its own
  void quantize(const float* x, int64_t r, int64_t b0, int64_t b1, int64_t level) {
    const int64_t nb = K / kBlock;
    int8_t* qr = q.data() + r * K + b0 * kBlock;
    if (level >= TILES_AVX2) {
      quantize_row_avx2(x + r * K + b0 * kBlock, b1 - b0, qr, dx.data() + r * nb + b0, qs.data() + r * nb + b0);
    } else {
      quantize_row_scalar(x + r * K + b0 * kBlock, b1 - b0, qr, dx.data() + r * nb + b0, qs.data() + r * nb + b0);
    }
  }
};

// Tiles [t0, t1) of y (M, ldy) = xq (M rows) @ W.T. The tiles go in chunks of about 128 KiB of weights,
// and every 4 rows of x pass over a chunk while it is in cache: passing over the whole range once per 4
// rows would read a large weight (SmolLM2's 30 MB head) from memory M / 4 times (measured on AMD EPYC:
// 256 rows through the head took 221 ms that way).
void tiles_range(int64_t kind, int64_t level, const uint8_t* w, int64_t nb, const QuantizedX* xq, int64_t M, float* y,
                 int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = nb * kTile * block_bytes(kind);
  const int64_t chunk = M <= 4 ? t1 - t0 : std::max<int64_t>(1, (128 << 10) / tile_bytes);
  for (int64_t c0 = t0; c0 < t1; c0 += chunk) {
    const int64_t c1 = std::min(t1, c0 + chunk);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t mc = std::min<int64_t>(4, M - m0);
      const TilesFn fn = kind == Q4_0   ? tiles_for<Q4_0>(level, mc)
                         : kind == Q4_1 ? tiles_for<Q4_1>(level, mc)
                                        : tiles_for<Q8_0>(level, mc);
      fn(w, nb, xq + m0, y + m0 * ldy, ldy, c0, c1);
    }
  }
}

// y (M, N) = x (M, K) @ W.T for a tiled W of out_features rows; x quantized to int8 per block of 32
at::Tensor qmatmul_tiles(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t in_features,
                         int64_t out_features, int64_t isa) {
  check_weight(w, kind, in_features);
  const int64_t level = resolve_tile_isa(isa);
  TORCH_CHECK(w.size(0) % kTile == 0 && out_features <= w.size(0) && out_features > w.size(0) - kTile,
              "attnlab quant: a tiled tensor of ", w.size(0), " rows cannot hold ", out_features, " outputs");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == in_features,
              "attnlab quant: x must be a 2-D float32 CPU tensor with ", in_features, " columns, got ", x.scalar_type(),
              " of ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), Np = w.size(0), nb = in_features / kBlock, tiles = Np / kTile;
  at::Tensor y = at::empty({M, Np}, xc.options());
  if (M == 0) return y.narrow(1, 0, out_features);
  QuantBuf xq(M, in_features);
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, M, 32, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) xq.quantize(xp, m, 0, nb, level);
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t passes = (M + 3) / 4;  // the kernels take up to 4 rows of x per pass over a tile
  if (tiles * nb * passes < kSerialBlockTiles) {  // too small to be worth waking a second thread
    tiles_range(kind, level, wp, nb, xq.rows.data(), M, yp, Np, 0, tiles);
  } else {
    const int64_t grain = std::max<int64_t>(1, tiles / (2 * at::get_num_threads()));
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      tiles_range(kind, level, wp, nb, xq.rows.data(), M, yp, Np, t0, t1);
    });
  }
  return Np == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

// The quantize_row that the tiled kernel runs at `isa`, on one row (for the tests: both give the same bytes).
std::tuple<at::Tensor, at::Tensor> quantize_x(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 1 && x.size(0) % kBlock == 0,
              "attnlab quant: x must be a 1-D float32 CPU tensor of a multiple of 32 values, got ", x.scalar_type(),
              " of ", x.sizes());
  const int64_t level = resolve_tile_isa(isa), nb = x.size(0) / kBlock;
  QuantBuf xq(1, x.size(0));
  xq.quantize(x.contiguous().data_ptr<float>(), 0, 0, nb, level);
  at::Tensor q = at::empty({x.size(0)}, x.options().dtype(at::kChar));
  std::memcpy(q.data_ptr<int8_t>(), xq.q.data(), xq.q.size());
  return {q, at::tensor(xq.dx, x.options())};
}

int64_t cpu_tile_isa() { return best_tile_isa(); }

// ==== one decode step of a Llama whose projections are all tiled (the C++ fast path) ===============
//
// The same computation as attnlab.models.llama.Llama.forward for one new token per row, with KV
// caches in position mode: embedding row, then per block RMSNorm -> Q|K|V (one tiled matmul) ->
// RoPE (HF's rotate_half pairing) -> K, V written at `slot` -> attention of each query head over
// its K/V head's slots 0..slot that are not padding -> out_proj -> residual -> RMSNorm -> gate|up ->
// silu(gate) * up -> down -> residual; final RMSNorm and the output head. It exists because the
// Python step is made of many small ops: for SmolLM2 it took 14 ms compiled and 24 ms eager, this one
// 4.3 ms (measured on a 2-core Xeon with VNNI; 5.3-6 ms with AVX2 on a 2-core AMD EPYC).
//
// weights, in order: per block [attn_norm (E), qkv tiles, out tiles, mlp_norm (E), gate_up tiles,
// down tiles], then [final norm (E), head tiles (the embedding's when tied)], then [embedding tiles].
// kinds: the GGML type of each tiled weight, in the same order (norms skipped).
// dims: [n_layer, H, G, D, E, F, V]

void rms_norm(const float* x, const float* w, float eps, int64_t E, float* out) {
  double ss = 0.0;  // float32 in torch's mean; float64 here changes the last bit at most
  for (int64_t i = 0; i < E; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / E) + eps);
  for (int64_t i = 0; i < E; ++i) out[i] = w[i] * (x[i] * r);
}

void rope_row(float* v, const float* cs, const float* sn, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = v[i], b = v[i + h];
    v[i] = a * cs[i] - b * sn[i];
    v[i + h] = b * cs[i + h] + a * sn[i + h];
  }
}

// ==== one-query decode attention over the KV cache: float32, float16, bfloat16 or int8 rows =============
//
// At long contexts a decode step is the read of its KV cache (SmolLM2 at 7000 tokens: 89% of the step was
// attention), so this kernel is built around the bytes:
// - the rep = H / G query heads of a K/V group go through the group's keys together: each cached row
//   comes from memory once per group, not once per head;
// - the keys are split across the workers (split-K): each takes a contiguous range of slots with its own
//   running max m, sum l and accumulator per head, and the partial softmaxes are merged afterwards by
//   their log-sum-exp (merge_head);
// - keys go in blocks of kKeys = 16: the block's rows are made float32 once (float16 / bfloat16 / int8
//   converted in registers), the rep x 16 scores come out of one transposing reduction (no horizontal
//   sum per key), their exponentials are taken 16 lanes at a time by a polynomial (exp_avx512), and the
//   values are added with every head's accumulator held in registers.
// Cache rows (attnlab.KVCache): (B, G, S, D) of float32, float16, bfloat16 or int8; int8 rows carry one
// float32 scale per qb values, (B, G, S, D / qb): value = scale * q, symmetric, as GGML's Q8_0 blocks.

enum CacheKind : int64_t { CACHE_F32 = 0, CACHE_F16 = 1, CACHE_BF16 = 2, CACHE_I8 = 3 };
constexpr int64_t kKeys = 16;  // keys per block
constexpr int kHeadsMax = 4;   // query heads per pass over a block (rep = 3: one pass; rep = 8: two)

// The S rows of one (row, K/V head)'s keys or values.
struct CacheRows {
  uint8_t* data = nullptr;
  float* scale = nullptr;  // int8 only: D / qb per row
  int64_t kind = CACHE_F32;
  int64_t D = 0, qb = 0;
  // int8: the scales of a row (D / qb) and log2(qb) where qb is a power of two (-1 otherwise), so that the vector
  // loads find a value's scale with a shift rather than an integer division per 16 values.
  int64_t per_row = 1, qshift = -1;
  int64_t elem() const { return kind == CACHE_F32 ? 4 : kind == CACHE_I8 ? 1 : 2; }
  CacheRows at(int64_t offset_rows) const {  // the rows from `offset_rows` on
    CacheRows r = *this;
    r.data += offset_rows * D * elem();
    if (scale) r.scale += offset_rows * per_row;
    return r;
  }
};

int64_t cache_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CACHE_F32;
    case at::kHalf: return CACHE_F16;
    case at::kBFloat16: return CACHE_BF16;
    case at::kChar: return CACHE_I8;
    default: TORCH_CHECK(false, "attnlab quant: a KV cache of ", t, " is not read by the decode kernel (float32, "
                                "float16, bfloat16 or int8 with scales)");
  }
  return CACHE_F32;
}

// Row `j` written from D floats, rounded as torch rounds: float16 / bfloat16 to nearest even; int8 per block of
// qb values, d = max|x| / 127 and q = round(x / d) (attnlab.core.kv_cache.quantize_int8 does the same).
void write_cache_row(const CacheRows& c, int64_t j, const float* x) {
  const int64_t D = c.D;
  if (c.kind == CACHE_F32) {
    std::memcpy(c.data + j * D * 4, x, D * sizeof(float));
  } else if (c.kind == CACHE_F16) {
    c10::Half* o = reinterpret_cast<c10::Half*>(c.data) + j * D;
    for (int64_t d = 0; d < D; ++d) o[d] = c10::Half(x[d]);
  } else if (c.kind == CACHE_BF16) {
    c10::BFloat16* o = reinterpret_cast<c10::BFloat16*>(c.data) + j * D;
    for (int64_t d = 0; d < D; ++d) o[d] = c10::BFloat16(x[d]);
  } else {
    int8_t* o = reinterpret_cast<int8_t*>(c.data) + j * D;
    for (int64_t b = 0; b < D / c.qb; ++b) {
      float amax = 0.0f;
      for (int64_t d = b * c.qb; d < (b + 1) * c.qb; ++d) amax = std::max(amax, std::fabs(x[d]));
      const float scale = amax / 127.0f;
      c.scale[j * (D / c.qb) + b] = scale;
      for (int64_t d = b * c.qb; d < (b + 1) * c.qb; ++d)
        o[d] = scale == 0.0f ? 0 : static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / scale), -127.0f, 127.0f));
    }
  }
}

// ---- plain C++ -----------------------------------------------------------------------------------------

void rows_to_float_scalar(const CacheRows& c, int64_t n, float* out) {
  const int64_t D = c.D;
  for (int64_t i = 0; i < n * D; ++i) {
    switch (c.kind) {
      case CACHE_F32: out[i] = reinterpret_cast<const float*>(c.data)[i]; break;
      case CACHE_F16: out[i] = static_cast<float>(reinterpret_cast<const c10::Half*>(c.data)[i]); break;
      case CACHE_BF16: out[i] = static_cast<float>(reinterpret_cast<const c10::BFloat16*>(c.data)[i]); break;
      default: out[i] = static_cast<float>(reinterpret_cast<const int8_t*>(c.data)[i]) * c.scale[(i / D) * (D / c.qb) + (i % D) / c.qb];
    }
  }
}

template <int HB>
void scores_scalar(const float* q, const float* k, int64_t n, int64_t D, float* s) {
  for (int h = 0; h < HB; ++h)
    for (int64_t i = 0; i < kKeys; ++i) {
      float dot = 0.0f;
      if (i < n)
        for (int64_t d = 0; d < D; ++d) dot += q[h * D + d] * k[i * D + d];
      s[h * kKeys + i] = dot;
    }
}

// The block's weights in place of its scores s (kKeys; lanes >= n and padding slots weigh 0), and the running
// max m and sum l updated; returns the factor exp(m_old - m_new) on the accumulator.
// What the running sums are multiplied by when the running max goes from m to mn: exp(m - mn), 0 before the first
// key, and 1 without calling exp where the max did not move (most blocks past the first few).
inline float rescale(float m, float mn) { return m == -INFINITY ? 0.0f : m == mn ? 1.0f : std::exp(m - mn); }

float softmax_block_scalar(float* s, int64_t n, const bool* pad, float& m, float& l) {
  float bm = -INFINITY;
  for (int64_t i = 0; i < kKeys; ++i) {
    if (i >= n || (pad && pad[i])) s[i] = -INFINITY;
    bm = std::max(bm, s[i]);
  }
  const float mn = std::max(m, bm);
  if (mn == -INFINITY) {  // nothing attended yet: every slot so far is padding
    std::fill(s, s + kKeys, 0.0f);
    return 1.0f;
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < kKeys; ++i) sum += (s[i] = s[i] == -INFINITY ? 0.0f : std::exp(s[i] - mn));
  const float alpha = rescale(m, mn);
  l = l * alpha + sum;
  m = mn;
  return alpha;
}

template <int HB>
void add_values_scalar(const float* p, const float* alpha, const float* v, int64_t n, int64_t D, float* acc) {
  for (int h = 0; h < HB; ++h)
    for (int64_t d = 0; d < D; ++d) {
      float a = acc[h * D + d] * alpha[h];
      for (int64_t i = 0; i < n; ++i) a += p[h * kKeys + i] * v[i * D + d];
      acc[h * D + d] = a;
    }
}

// ---- AVX-512 -----------------------------------------------------------------------------------------------

// Lane j of the result = the sum of the 16 lanes of v[j]: a transposing tree of 15 adds for 16 sums.
ATTNLAB_AVX512 inline __m512 sum16_avx512(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: keys 4i..4i+3, each a quarter of its sum
    const __m512d c = _mm512_castps_pd(x[2 * i]), d = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x) on 16 lanes, x <= 0 (a score minus the running max): x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7
// Taylor polynomial (relative error < 1e-8 before float32 rounding), times 2^n. Below -87 (and -inf) it gives 0.
ATTNLAB_AVX512 inline __m512 exp_avx512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts: r is exact-ish
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

ATTNLAB_AVX512 float softmax_block_avx512(float* s, int64_t n, const bool* pad, float& m, float& l) {
  __mmask16 valid = n >= kKeys ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  if (pad) {  // slots flagged True are padding: only this block's n bytes are read
    const __m128i flags = _mm_maskz_loadu_epi8(valid, pad);
    valid &= _mm_cmpeq_epi8_mask(flags, _mm_setzero_si128());
  }
  const __m512 x = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(s));
  const float mn = std::max(m, _mm512_reduce_max_ps(x));
  if (mn == -INFINITY) {  // nothing attended yet: every slot so far is padding
    _mm512_storeu_ps(s, _mm512_setzero_ps());
    return 1.0f;
  }
  const __m512 p = _mm512_maskz_mov_ps(valid, exp_avx512(_mm512_sub_ps(x, _mm512_set1_ps(mn))));
  _mm512_storeu_ps(s, p);
  const float alpha = rescale(m, mn);
  l = l * alpha + _mm512_reduce_add_ps(p);
  m = mn;
  return alpha;
}


// The scores and the values read the cache rows where they lie: each 16 values converted in registers as they
// are used (converting a block into a buffer first cost a store and a load per value, and measured slower over
// float16 than over float32 rows). add_rows: acc (HB, D) = alpha * acc + p (HB, kKeys) @ v (n, D), CW chunks of
// 16 columns of every head held in registers per pass.
template <int64_t KIND>
ATTNLAB_AVX512 inline __m512 load16_avx512(const CacheRows& c, int64_t i, int64_t d) {
  const int64_t at = i * c.D + d;
  if constexpr (KIND == CACHE_F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(c.data) + at);
  } else if constexpr (KIND == CACHE_F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(c.data) + at)));
  } else if constexpr (KIND == CACHE_BF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(c.data) + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const int8_t*>(c.data) + at));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(c.scale[i * c.per_row + (d >> c.qshift)]));
  }
}

template <int HB, int64_t KIND>
ATTNLAB_AVX512 void scores_rows_avx512(const float* q, const CacheRows& k, int64_t n, int64_t D, float* s) {
  __m512 part[HB][kKeys];
  for (int64_t i = 0; i < kKeys; ++i) {
    __m512 a[HB];
    for (int h = 0; h < HB; ++h) a[h] = _mm512_setzero_ps();
    if (i < n)
      for (int64_t c = 0; c < D; c += 16) {
        const __m512 kv = load16_avx512<KIND>(k, i, c);
        for (int h = 0; h < HB; ++h) a[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + c), kv, a[h]);
      }
    for (int h = 0; h < HB; ++h) part[h][i] = a[h];
  }
  for (int h = 0; h < HB; ++h) _mm512_storeu_ps(s + h * kKeys, sum16_avx512(part[h]));
}

// The scales of block `blk` of keys 0..15 (0 past n), from rows of per_row scales.
ATTNLAB_AVX512 inline __m512 block_scales_avx512(const CacheRows& v, int64_t n, int64_t blk) {
  const __mmask16 live = n >= kKeys ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  if (v.per_row == 2) {  // 16 keys' two scales are 32 floats in a row: take every other one
    const int64_t floats = 2 * std::min(n, kKeys);  // the first 2n are read
    const __mmask16 lo = static_cast<__mmask16>((1u << std::min<int64_t>(floats, 16)) - 1);
    const __mmask16 hi = static_cast<__mmask16>((1u << std::max<int64_t>(floats - 16, 0)) - 1);
    const __m512 a = _mm512_maskz_loadu_ps(lo, v.scale), b = _mm512_maskz_loadu_ps(hi, v.scale + 16);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(static_cast<int32_t>(blk))), b);
  }
  const __m512i at = _mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int32_t>(v.per_row))),
      _mm512_set1_epi32(static_cast<int32_t>(blk)));
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, v.scale, 4);
}

template <int HB, int CW, int64_t KIND>
ATTNLAB_AVX512 inline void add_rows_pass_avx512(const float* p, const float* alpha, const CacheRows& v, int64_t n,
                                                int64_t D, float* acc, int64_t c) {
  __m512 a[HB][CW];
  for (int h = 0; h < HB; ++h)
    for (int w = 0; w < CW; ++w) a[h][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + c + 16 * w), _mm512_set1_ps(alpha[h]));
  if constexpr (KIND == CACHE_I8) {
    // int8 rows: each weight times its key's scale once per 16 values (ps), not each value times its scale
    alignas(64) float ps[CW][HB][kKeys];
    for (int w = 0; w < CW; ++w) {
      const __m512 sc = block_scales_avx512(v, n, (c + 16 * w) >> v.qshift);
      for (int h = 0; h < HB; ++h) _mm512_store_ps(ps[w][h], _mm512_mul_ps(_mm512_loadu_ps(p + h * kKeys), sc));
    }
    const int8_t* rows = reinterpret_cast<const int8_t*>(v.data);
    for (int64_t i = 0; i < n; ++i) {
      for (int w = 0; w < CW; ++w) {
        const __m512 vv = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + i * D + c + 16 * w))));
        for (int h = 0; h < HB; ++h) a[h][w] = _mm512_fmadd_ps(_mm512_set1_ps(ps[w][h][i]), vv, a[h][w]);
      }
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      __m512 vv[CW];
      for (int w = 0; w < CW; ++w) vv[w] = load16_avx512<KIND>(v, i, c + 16 * w);
      for (int h = 0; h < HB; ++h) {
        const __m512 e = _mm512_set1_ps(p[h * kKeys + i]);
        for (int w = 0; w < CW; ++w) a[h][w] = _mm512_fmadd_ps(e, vv[w], a[h][w]);
      }
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int w = 0; w < CW; ++w) _mm512_storeu_ps(acc + h * D + c + 16 * w, a[h][w]);
}

template <int HB, int64_t KIND>
ATTNLAB_AVX512 void add_rows_avx512(const float* p, const float* alpha, const CacheRows& v, int64_t n, int64_t D,
                                    float* acc) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) add_rows_pass_avx512<HB, 4, KIND>(p, alpha, v, n, D, acc, c);
  for (; c < D; c += 16) add_rows_pass_avx512<HB, 1, KIND>(p, alpha, v, n, D, acc, c);
}

// ---- AVX2 ----------------------------------------------------------------------------------------------------

ATTNLAB_AVX2 void rows_to_float_avx2(const CacheRows& c, int64_t n, float* out) {
  const int64_t D = c.D;
  if (c.kind == CACHE_F16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(c.data);
    for (int64_t i = 0; i < n * D; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
  } else if (c.kind == CACHE_BF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(c.data);
    for (int64_t i = 0; i < n * D; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  } else if (c.kind == CACHE_I8) {
    const int8_t* p = reinterpret_cast<const int8_t*>(c.data);
    const int64_t per_row = D / c.qb;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i * D + d))));
        _mm256_storeu_ps(out + i * D + d, _mm256_mul_ps(x, _mm256_set1_ps(c.scale[i * per_row + d / c.qb])));
      }
  } else {
    rows_to_float_scalar(c, n, out);
  }
}

// Lane j of the result = the sum of the 8 lanes of v[j].
ATTNLAB_AVX2 inline __m256 sum8_avx2(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // halves: keys 0-3 | 4-7, per 128 bits
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <int HB>
ATTNLAB_AVX2 void scores_avx2(const float* q, const float* k, int64_t n, int64_t D, float* s) {
  __m256 part[HB][kKeys];
  for (int64_t i = 0; i < kKeys; ++i) {
    __m256 a[HB];
    for (int h = 0; h < HB; ++h) a[h] = _mm256_setzero_ps();
    if (i < n)
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 kv = _mm256_loadu_ps(k + i * D + c);
        for (int h = 0; h < HB; ++h) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + c), kv, a[h]);
      }
    for (int h = 0; h < HB; ++h) part[h][i] = a[h];
  }
  for (int h = 0; h < HB; ++h) {
    _mm256_storeu_ps(s + h * kKeys, sum8_avx2(part[h]));
    _mm256_storeu_ps(s + h * kKeys + 8, sum8_avx2(part[h] + 8));
  }
}

// exp_avx512's polynomial on 8 lanes; 2^n built in the exponent bits (n >= -126 after the clamp).
ATTNLAB_AVX2 inline __m256 exp_avx2(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

ATTNLAB_AVX2 float softmax_block_avx2(float* s, int64_t n, const bool* pad, float& m, float& l) {
  for (int64_t i = 0; i < kKeys; ++i)
    if (i >= n || (pad && pad[i])) s[i] = -INFINITY;
  const __m256 x0 = _mm256_loadu_ps(s), x1 = _mm256_loadu_ps(s + 8);
  alignas(32) float mx[8];
  _mm256_store_ps(mx, _mm256_max_ps(x0, x1));
  const float mn = std::max(m, *std::max_element(mx, mx + 8));
  if (mn == -INFINITY) {
    std::fill(s, s + kKeys, 0.0f);
    return 1.0f;
  }
  const __m256 p0 = exp_avx2(_mm256_sub_ps(x0, _mm256_set1_ps(mn))), p1 = exp_avx2(_mm256_sub_ps(x1, _mm256_set1_ps(mn)));
  _mm256_storeu_ps(s, p0);
  _mm256_storeu_ps(s + 8, p1);
  const float alpha = rescale(m, mn);
  l = l * alpha + hsum256(_mm256_add_ps(p0, p1));
  m = mn;
  return alpha;
}

template <int HB>
ATTNLAB_AVX2 void add_values_avx2(const float* p, const float* alpha, const float* v, int64_t n, int64_t D,
                                  float* acc) {
  for (int64_t c = 0; c < D; c += 16) {  // D % 16 == 0 on this path
    __m256 a[HB][2];
    for (int h = 0; h < HB; ++h)
      for (int w = 0; w < 2; ++w) a[h][w] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + c + 8 * w), _mm256_set1_ps(alpha[h]));
    for (int64_t i = 0; i < n; ++i) {
      const __m256 v0 = _mm256_loadu_ps(v + i * D + c), v1 = _mm256_loadu_ps(v + i * D + c + 8);
      for (int h = 0; h < HB; ++h) {
        const __m256 e = _mm256_set1_ps(p[h * kKeys + i]);
        a[h][0] = _mm256_fmadd_ps(e, v0, a[h][0]);
        a[h][1] = _mm256_fmadd_ps(e, v1, a[h][1]);
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int w = 0; w < 2; ++w) _mm256_storeu_ps(acc + h * D + c + 8 * w, a[h][w]);
  }
}

// ---- AVX-512 VNNI: an int8 cache's keys times the query rounded to int8 ----------------------------------
// GGML's q8_0 x q8_0 dot product, the one llama.cpp runs over a `-ctk q8_0` cache: the query (already times the
// softmax scale) is rounded per block of 32 values to int8 with its own scale d = max|q| / 127 (prepare_q8), and
// vpdpbusd takes 64 byte products an instruction where the float rows convert, scale and multiply 16 values at a
// time. Measured (AMD EPYC Zen 4, one thread, 9 query heads over 3 K/V heads of 8192 int8 slots, CPU time of one
// call): 0.475 ms reading the keys as floats, 0.358 ms with this. Keeping a second byte of the query (q = d (hi +
// lo / 128), two more instructions a key and head) gave 0.411 ms. What the rounded query costs: the int8 cache's
// worst error against the float32 cache went from 0.0125 to 0.0203 of max |output| (random unit keys and values,
// D 32-128, 1-2048 slots, 20 seeds; tests/test_kv_cache_dtype.py holds it to INT8_OUTPUT_BOUND).
// vpdpbusd multiplies unsigned by signed bytes: the key bytes are made unsigned, k + 128 = k ^ 0x80, and each
// block's sums give back 128 * sum(q) (corr).
// A prepared head (D floats of room): D int8 values, D / 32 float scales, D / 32 int32 corrections.
constexpr int64_t kQ8Block = 32;

void prepare_q8(const float* q, int64_t rep, int64_t D, float* out) {
  for (int64_t h = 0; h < rep; ++h) {
    float* base = out + h * D;
    int8_t* qi = reinterpret_cast<int8_t*>(base);
    float* d = base + D / 4;
    int32_t* corr = reinterpret_cast<int32_t*>(d + D / kQ8Block);
    for (int64_t b = 0; b < D / kQ8Block; ++b) {
      const float* x = q + h * D + b * kQ8Block;
      float amax = 0.0f;
      for (int64_t i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int64_t i = 0; i < kQ8Block; ++i) {
        qi[b * kQ8Block + i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
        sum += qi[b * kQ8Block + i];
      }
      d[b] = amax / 127.0f;
      corr[b] = 128 * sum;
    }
  }
}

// Four keys' 16-lane sums reduced to one vector: per 128-bit lane L, the sums of keys 0..3 over lanes 4L..4L+3.
ATTNLAB_VNNI inline __m512i sum4_lanes_vnni(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// s (HB, kKeys) = q (HB heads, prepare_q8's) . k rows, D a multiple of 64 (two blocks of 32 per 64 bytes). Each key's
// 64 bytes give 16 int32 lanes; lanes 0-7 are block 0's, 8-15 block 1's. The reduction keeps the two blocks apart
// ([keys 0-3 of block 0 | keys 0-3 of block 1 | keys 4-7 of block 0 | keys 4-7 of block 1], the same for 8-15),
// so that each (key, block) sum is scaled by its key's and its query's scale before the blocks are added.
template <int HB>
ATTNLAB_VNNI void scores_q8_vnni(const float* qp, const CacheRows& k, int64_t n, int64_t D, float* s) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  const __m512i key_of = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7);
  const __m512i block_of = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  constexpr __mmask16 kBlock1 = 0xF0F0;
  const int8_t* rows = reinterpret_cast<const int8_t*>(k.data);
  __m512 total[HB];
  for (int h = 0; h < HB; ++h) total[h] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 64) {
    __m512i qv[HB];
    for (int h = 0; h < HB; ++h) qv[h] = _mm512_loadu_si512(reinterpret_cast<const int8_t*>(qp + h * D) + c);
    __m512i y[HB][4];  // per 4 keys
    for (int g = 0; g < 4; ++g) {
      __m512i p[HB][4];
      for (int j = 0; j < 4; ++j) {
        const int64_t i = 4 * g + j;
        const __m512i kv = i < n ? _mm512_xor_si512(_mm512_loadu_si512(rows + i * D + c), flip) : zero;
        for (int h = 0; h < HB; ++h) p[h][j] = _mm512_dpbusd_epi32(zero, kv, qv[h]);
      }
      for (int h = 0; h < HB; ++h) y[h][g] = sum4_lanes_vnni(p[h][0], p[h][1], p[h][2], p[h][3]);
    }
    // the keys' scales in the reduction's lane order (keys past n are not read: 0)
    __m512 sk[2];
    for (int half = 0; half < 2; ++half) {
      const __m512i key = _mm512_add_epi32(key_of, _mm512_set1_epi32(8 * half));
      const __mmask16 live = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(n)));
      const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(key, _mm512_set1_epi32(static_cast<int32_t>(k.per_row))),
                                          _mm512_add_epi32(block_of, _mm512_set1_epi32(static_cast<int32_t>(c / kQ8Block))));
      sk[half] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, k.scale, 4);
    }
    for (int h = 0; h < HB; ++h) {
      const float* d = qp + h * D + D / 4 + c / kQ8Block;
      const int32_t* corr = reinterpret_cast<const int32_t*>(qp + h * D + D / 4 + D / kQ8Block) + c / kQ8Block;
      const __m512 dq = _mm512_mask_blend_ps(kBlock1, _mm512_set1_ps(d[0]), _mm512_set1_ps(d[1]));
      const __m512i cq = _mm512_mask_blend_epi32(kBlock1, _mm512_set1_epi32(corr[0]), _mm512_set1_epi32(corr[1]));
      __m512 f[2];
      for (int half = 0; half < 2; ++half) {
        const __m512i a = y[h][2 * half], b = y[h][2 * half + 1];
        const __m512i blocks = _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                                _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
        f[half] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(blocks, cq)), _mm512_mul_ps(sk[half], dq));
      }
      total[h] = _mm512_add_ps(total[h], _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                                       _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(3, 1, 3, 1))));
    }
  }
  for (int h = 0; h < HB; ++h) _mm512_storeu_ps(s + h * kKeys, total[h]);
}

// ---- dispatch and the range loop ---------------------------------------------------------------------------

using ScoresFn = void (*)(const float*, const float*, int64_t, int64_t, float*);
using ValuesFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, float*);
using ScoresRowsFn = void (*)(const float*, const CacheRows&, int64_t, int64_t, float*);
using ValuesRowsFn = void (*)(const float*, const float*, const CacheRows&, int64_t, int64_t, float*);

struct AttnOps {
  void (*to_float)(const CacheRows&, int64_t, float*) = nullptr;
  ScoresFn scores[kHeadsMax] = {};  // [HB - 1]
  float (*softmax)(float*, int64_t, const bool*, float&, float&) = nullptr;
  ValuesFn values[kHeadsMax] = {};
  ScoresRowsFn scores_rows[kHeadsMax] = {};  // AVX-512: the cache's rows read in place, in place of the three above
  ValuesRowsFn values_rows[kHeadsMax] = {};
  void (*prepare_q)(const float*, int64_t, int64_t, float*) = nullptr;  // VNNI: scores_rows take prepare_q8's heads
};

template <int64_t KIND>
AttnOps avx512_rows_ops() {
  AttnOps ops;
  ops.softmax = softmax_block_avx512;
  const ScoresRowsFn scores[kHeadsMax] = {scores_rows_avx512<1, KIND>, scores_rows_avx512<2, KIND>,
                                          scores_rows_avx512<3, KIND>, scores_rows_avx512<4, KIND>};
  const ValuesRowsFn values[kHeadsMax] = {add_rows_avx512<1, KIND>, add_rows_avx512<2, KIND>, add_rows_avx512<3, KIND>,
                                          add_rows_avx512<4, KIND>};
  std::copy(scores, scores + kHeadsMax, ops.scores_rows);
  std::copy(values, values + kHeadsMax, ops.values_rows);
  return ops;
}

// The vector paths need D a multiple of 16 (and int8 scale blocks of 16s); any other shape runs plain C++. The
// AVX-512 rows read int8 scales by a shift: blocks of a power of two. isa = VNNI_Q8 reads an int8 cache of blocks
// of 32 and D a multiple of 64 with int8 products (scores_q8_vnni), any other cache as AVX-512 does.
AttnOps attn_ops(int64_t isa, int64_t D, int64_t qb, int64_t kind) {
  if (isa == VNNI_Q8 && kind == CACHE_I8 && qb == kQ8Block && D % 64 == 0) {
    AttnOps ops = avx512_rows_ops<CACHE_I8>();
    const ScoresRowsFn scores[kHeadsMax] = {scores_q8_vnni<1>, scores_q8_vnni<2>, scores_q8_vnni<3>, scores_q8_vnni<4>};
    std::copy(scores, scores + kHeadsMax, ops.scores_rows);
    ops.prepare_q = prepare_q8;
    return ops;
  }
  if (isa == VNNI_Q8) isa = AVX512;
  const bool fits = D % 16 == 0 && qb % 16 == 0;
  if (isa >= AVX512 && fits && (kind != CACHE_I8 || (qb & (qb - 1)) == 0)) {
    switch (kind) {
      case CACHE_F16: return avx512_rows_ops<CACHE_F16>();
      case CACHE_BF16: return avx512_rows_ops<CACHE_BF16>();
      case CACHE_I8: return avx512_rows_ops<CACHE_I8>();
      default: return avx512_rows_ops<CACHE_F32>();
    }
  }
  if (isa >= AVX2 && fits)
    return {rows_to_float_avx2,
            {scores_avx2<1>, scores_avx2<2>, scores_avx2<3>, scores_avx2<4>},
            softmax_block_avx2,
            {add_values_avx2<1>, add_values_avx2<2>, add_values_avx2<3>, add_values_avx2<4>}};
  return {rows_to_float_scalar,
          {scores_scalar<1>, scores_scalar<2>, scores_scalar<3>, scores_scalar<4>},
          softmax_block_scalar,
          {add_values_scalar<1>, add_values_scalar<2>, add_values_scalar<3>, add_values_scalar<4>}};
}

// Floats of scratch attend_range needs: a block of K and of V as float32, the scores and the factors, the prepared query.
int64_t attend_work_floats(int64_t rep, int64_t D) { return 2 * kKeys * D + rep * (kKeys + 1) + rep * D; }

// Slots [j0, j1) of one K/V group for its rep query heads q (rep, D), pre-scaled by the softmax scale: updates
// the running max m (rep), sum l (rep) and accumulator acc (rep, D). pad: the group row's (S,) flags, or null.
void attend_range(const AttnOps& ops, const float* q, int64_t rep, const CacheRows& K, const CacheRows& V,
                  const bool* pad, int64_t j0, int64_t j1, float* m, float* l, float* acc, float* work) {
  const int64_t D = K.D;
  float* kb = work;
  float* vb = kb + kKeys * D;
  float* s = vb + kKeys * D;  // (rep, kKeys)
  float* alpha = s + rep * kKeys;
  const float* qk = q;  // what the scores read: q, or its int8 heads
  if (ops.prepare_q) {
    ops.prepare_q(q, rep, D, alpha + rep);
    qk = alpha + rep;
  }
  for (int64_t j = j0; j < j1; j += kKeys) {
    const int64_t n = std::min(kKeys, j1 - j);
    const CacheRows kr = K.at(j), vr = V.at(j);
    const bool in_place = ops.scores_rows[0] != nullptr;
    const float* kp = in_place || kr.kind == CACHE_F32 ? reinterpret_cast<const float*>(kr.data) : (ops.to_float(kr, n, kb), kb);
    for (int64_t h0 = 0; h0 < rep; h0 += kHeadsMax) {
      const int64_t hb = std::min<int64_t>(kHeadsMax, rep - h0) - 1;
      in_place ? ops.scores_rows[hb](qk + h0 * D, kr, n, D, s + h0 * kKeys) : ops.scores[hb](q + h0 * D, kp, n, D, s + h0 * kKeys);
    }
    for (int64_t h = 0; h < rep; ++h) alpha[h] = ops.softmax(s + h * kKeys, n, pad ? pad + j : nullptr, m[h], l[h]);
    const float* vp = in_place || vr.kind == CACHE_F32 ? reinterpret_cast<const float*>(vr.data) : (ops.to_float(vr, n, vb), vb);
    for (int64_t h0 = 0; h0 < rep; h0 += kHeadsMax) {
      const int64_t hb = std::min<int64_t>(kHeadsMax, rep - h0) - 1;
      in_place ? ops.values_rows[hb](s + h0 * kKeys, alpha + h0, vr, n, D, acc + h0 * D)
               : ops.values[hb](s + h0 * kKeys, alpha + h0, vp, n, D, acc + h0 * D);
    }
  }
}

// One head's output (D,) from nt workers' partial softmaxes, merged by their log-sum-exp: worker t's m, l and
// acc (D) are at pm[t * heads + head], pl[...], pacc[(t * heads + head) * D]. No slot attended: zeros.
void merge_head(int nt, int64_t heads, int64_t head, int64_t D, const float* pm, const float* pl, const float* pacc,
                float* out) {
  float mx = -INFINITY;
  for (int t = 0; t < nt; ++t) mx = std::max(mx, pm[t * heads + head]);
  std::fill(out, out + D, 0.0f);
  if (mx == -INFINITY) return;
  float den = 0.0f;
  for (int t = 0; t < nt; ++t) {
    const float mt = pm[t * heads + head];
    if (mt == -INFINITY) continue;
    const float w = std::exp(mt - mx);
    den += w * pl[t * heads + head];
    const float* a = pacc + (t * heads + head) * D;
    for (int64_t d = 0; d < D; ++d) out[d] += w * a[d];
  }
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// [lo, hi) of n items for worker `tid` of `nt` (the first n % nt workers take one more)
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int nt) {
  const int64_t base = n / nt, extra = n % nt;
  const int64_t lo = tid * base + std::min<int64_t>(tid, extra);
  return {lo, lo + base + (tid < extra ? 1 : 0)};
}

// This worker's share of the tiles of y (B, ldy) = xq (B rows) @ W.T, W tiled of kind `kind`
void tiles_share(const at::Tensor& w, int64_t kind, int64_t level, const QuantBuf& xq, int64_t B, float* y,
                 int64_t ldy, int tid, int nt) {
  const int64_t nb = xq.K / kBlock;
  const auto [t0, t1] = share(w.size(0) / kTile, tid, nt);
  tiles_range(kind, level, w.data_ptr<uint8_t>(), nb, xq.rows.data(), B, y, ldy, t0, t1);
}

inline int worker_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int worker_count() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

inline void all_workers_meet() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

// The rows of (row b, K/V head g) of a (B, G, S, D) cache, with its (B, G, S, D / qb) scales when int8.
CacheRows cache_rows(const at::Tensor& c, const at::Tensor* scale, int64_t b, int64_t g) {
  const int64_t G = c.size(1), S = c.size(2), D = c.size(3);
  CacheRows r;
  r.kind = cache_kind(c.scalar_type());
  r.D = D;
  r.qb = D;
  r.data = static_cast<uint8_t*>(c.data_ptr()) + (b * G + g) * S * D * r.elem();
  if (r.kind == CACHE_I8) {
    r.qb = D / scale->size(3);
    r.per_row = D / r.qb;
    r.qshift = (r.qb & (r.qb - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(r.qb)) : -1;
    r.scale = scale->data_ptr<float>() + (b * G + g) * S * r.per_row;
  }
  return r;
}

void check_cache(const at::Tensor& c, const char* name, const at::Tensor& like, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.dim() == 4 && c.sizes() == like.sizes() &&
                  c.scalar_type() == like.scalar_type(),
              "attnlab quant: decode_attention's ", name, " must be a contiguous CPU (B, G, S, D) tensor like k, got ",
              c.scalar_type(), " of ", c.sizes());
  cache_kind(c.scalar_type());
  if (c.scalar_type() != at::kChar) return;
  TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->dim() == 4 &&
                  scale->sizes().slice(0, 3) == c.sizes().slice(0, 3) && scale->size(3) > 0 &&
                  c.size(3) % scale->size(3) == 0,
              "attnlab quant: an int8 ", name, " needs its float32 scales, a contiguous (B, G, S, D / block) tensor");
}

// out (B, H, D) float32: softmax(q k^T * scale) v of one query per row over slots [0, length) of the cache
// (padding slots skipped), the query heads of K/V head g being g * H / G ... (g + 1) * H / G - 1.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                            const std::optional<at::Tensor>& pad, int64_t length, double scale, int64_t isa) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3,
              "attnlab quant: decode_attention's q must be a (B, H, D) float32 CPU tensor, got ", q.scalar_type(),
              " of ", q.sizes());
  check_cache(k, "k", k, k_scale);
  check_cache(v, "v", k, v_scale);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), G = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && G > 0 && H % G == 0, "attnlab quant: q ", q.sizes(),
              " does not go with a cache of ", k.sizes(), " (B and D equal, H a multiple of G)");
  TORCH_CHECK(length >= 1 && length <= S, "attnlab quant: length=", length, " must be in [1, ", S, "]");
  at::Tensor padc;
  if (pad.has_value()) {
    TORCH_CHECK(pad->dim() == 2 && pad->size(0) == B && pad->size(1) == S, "attnlab quant: pad must be (B, S) = (", B,
                ", ", S, "), got ", pad->sizes());
    padc = pad->to(at::kBool).contiguous();
  }
  const at::Tensor qc = q.contiguous();
  const float* qp = qc.data_ptr<float>();
  // isa -1: the best this CPU has, VNNI_Q8 where it has VNNI (an int8 cache's keys then meet the query in int8)
  TORCH_CHECK(isa <= VNNI_Q8, "attnlab quant: decode_attention's isa must be -1 (the best), 0 (plain C++), 1 (AVX2), ",
              "2 (AVX-512) or 3 (AVX-512 VNNI), got ", isa);
  TORCH_CHECK(isa != VNNI_Q8 || has_vnni(), "attnlab quant: isa=3 (AVX-512 VNNI int8 products) was asked for, but "
              "this CPU has no AVX-512 VNNI; ask for isa=2 or -1");
  const int64_t level = isa == VNNI_Q8 || (isa < 0 && has_vnni()) ? VNNI_Q8 : resolve_isa(isa);
  const int64_t rep = H / G, heads = B * H;
  const at::Tensor* ks = k_scale.has_value() ? &*k_scale : nullptr;
  const at::Tensor* vs = v_scale.has_value() ? &*v_scale : nullptr;
  const AttnOps ops = attn_ops(level, D, cache_rows(k, ks, 0, 0).qb, cache_kind(k.scalar_type()));
  const int threads = std::max(1, at::get_num_threads());
  std::vector<float> pm(threads * heads), pl(threads * heads), pacc(threads * heads * D);
  int used = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
  {
    const int tid = worker_id(), nt = worker_count();
    if (tid == 0) used = nt;
    std::vector<float> qs(rep * D), work(attend_work_floats(rep, D));
    const auto [j0, j1] = share(length, tid, nt);  // split-K: this worker's slots of every row and group
    for (int64_t bg = 0; bg < B * G; ++bg) {
      const int64_t b = bg / G, g = bg % G, head0 = tid * heads + b * H + g * rep;
      for (int64_t i = 0; i < rep * D; ++i) qs[i] = qp[(b * H + g * rep) * D + i] * static_cast<float>(scale);
      std::fill(&pm[head0], &pm[head0] + rep, -INFINITY);
      std::fill(&pl[head0], &pl[head0] + rep, 0.0f);
      std::fill(&pacc[head0 * D], &pacc[head0 * D] + rep * D, 0.0f);
      attend_range(ops, qs.data(), rep, cache_rows(k, ks, b, g), cache_rows(v, vs, b, g),
                   padc.defined() ? padc.data_ptr<bool>() + b * S : nullptr, j0, j1, &pm[head0], &pl[head0],
                   &pacc[head0 * D], work.data());
    }
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  for (int64_t head = 0; head < heads; ++head)
    merge_head(used, heads, head, D, pm.data(), pl.data(), pacc.data(), out.data_ptr<float>() + head * D);
  return out;
}

at::Tensor llama_decode(const at::Tensor& tok, const at::Tensor& pos, const at::Tensor& slot, const at::Tensor& pad,
                        at::TensorList k_caches, at::TensorList v_caches, at::TensorList weights,
                        at::IntArrayRef kinds, at::IntArrayRef dims, double eps, double rope_base, int64_t isa,
                        std::optional<at::TensorList> k_scales_opt, std::optional<at::TensorList> v_scales_opt) {
  const at::TensorList k_scales = k_scales_opt.value_or(at::TensorList()), v_scales = v_scales_opt.value_or(at::TensorList());
  TORCH_CHECK(dims.size() == 7, "attnlab quant: dims = [n_layer, H, G, D, E, F, V]");
  const int64_t L = dims[0], H = dims[1], G = dims[2], D = dims[3], E = dims[4], Fh = dims[5], V = dims[6];
  const int64_t B = tok.size(0), S = pad.size(1);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * L + 3 && static_cast<int64_t>(kinds.size()) == 4 * L + 2,
              "attnlab quant: llama_decode got ", weights.size(), " weights and ", kinds.size(), " kinds for ", L,
              " blocks");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L,
              "attnlab quant: one K and one V cache per block");
  TORCH_CHECK(G > 0 && H % G == 0 && D % 2 == 0 && E % kBlock == 0 && Fh % kBlock == 0,
              "attnlab quant: dims ", dims, " are not a Llama the fused step runs");
  const bool int8_cache = k_caches[0].scalar_type() == at::kChar;
  TORCH_CHECK(!int8_cache || (static_cast<int64_t>(k_scales.size()) == L && static_cast<int64_t>(v_scales.size()) == L),
              "attnlab quant: an int8 KV cache needs one K and one V scale tensor per block");
  for (int64_t l = 0; l < L; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& c = kv ? v_caches[l] : k_caches[l];
      TORCH_CHECK(c.scalar_type() == k_caches[0].scalar_type() && c.is_contiguous() &&
                      c.sizes() == at::IntArrayRef({B, G, S, D}),
                  "attnlab quant: block ", l, "'s K/V cache must be a contiguous (", B, ", ", G, ", ", S, ", ", D,
                  ") tensor of ", k_caches[0].scalar_type(), " (float32, float16, bfloat16 or int8), got ",
                  c.scalar_type(), " of ", c.sizes());
      cache_kind(c.scalar_type());
      if (int8_cache) {
        const at::Tensor& sc = kv ? v_scales[l] : k_scales[l];
        TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.dim() == 4 &&
                        sc.sizes().slice(0, 3) == c.sizes().slice(0, 3) && sc.size(3) > 0 && D % sc.size(3) == 0,
                    "attnlab quant: block ", l, "'s int8 cache scales must be a contiguous float32 (", B, ", ", G,
                    ", ", S, ", D / block) tensor, got ", sc.scalar_type(), " of ", sc.sizes());
      }
    }
  for (int64_t i = 0; i < static_cast<int64_t>(weights.size()); ++i) {
    const bool norm = i < 6 * L ? (i % 6 == 0 || i % 6 == 3) : i == 6 * L;
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.scalar_type() == (norm ? at::kFloat : at::kByte),
                "attnlab quant: llama_decode's weight ", i, " must be a contiguous CPU ", norm ? "float32" : "uint8",
                " tensor, got ", w.scalar_type());
    if (!norm) TORCH_CHECK(w.size(0) % kTile == 0, "attnlab quant: weight ", i, " is not tiled (", w.size(0), " rows)");
  }
  const at::Tensor tokc = tok.to(at::kLong).contiguous(), posc = pos.to(at::kLong).contiguous();
  const at::Tensor padc = pad.to(at::kBool).contiguous();
  const int64_t s = slot.item<int64_t>();
  TORCH_CHECK(s >= 0 && s < S, "attnlab quant: slot ", s, " outside the cache's ", S, " slots");
  const int64_t KV = G * D, QKV = E + 2 * KV, rep = H / G;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t level = resolve_tile_isa(isa);
  const int64_t qb = cache_rows(k_caches[0], int8_cache ? &k_scales[0] : nullptr, 0, 0).qb;
  const AttnOps attend = attn_ops(level == TILES_SCALAR ? SCALAR : level == TILES_VNNI ? VNNI_Q8 : best_isa(), D, qb,
                                  cache_kind(k_caches[0].scalar_type()));
  const auto rows_of = [&](int64_t i) { return weights[i].size(0); };  // padded to 16
  const int64_t ldqkv = rows_of(1), ldo = rows_of(2), ldgu = rows_of(4), lddn = rows_of(5), ldv = rows_of(6 * L + 1);
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(rows_of(6 * l + 1) == ldqkv && rows_of(6 * l + 2) == ldo && rows_of(6 * l + 4) == ldgu &&
                    rows_of(6 * l + 5) == lddn && ldqkv >= QKV && ldo >= E && ldgu >= 2 * Fh && lddn >= E && ldv >= V,
                "attnlab quant: block ", l, "'s tiled weights do not have the rows dims ", dims, " call for");

  // x: the residual stream (B, E), from the embedding rows
  at::Tensor x = dequantize_tiles(weights[6 * L + 2], kinds[4 * L + 1], E, tokc);
  // cos/sin per row: angle = position * base^(-2i/D), channel c and c + D/2 share it (rope_cos_sin)
  std::vector<float> cs(B * D), sn(B * D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < D / 2; ++i) {
      const float inv = std::pow(static_cast<float>(rope_base), -static_cast<float>(2 * i) / static_cast<float>(D));
      const float a = static_cast<float>(posc.data_ptr<int64_t>()[b]) * inv;
      cs[b * D + i] = cs[b * D + i + D / 2] = std::cos(a);
      sn[b * D + i] = sn[b * D + i + D / 2] = std::sin(a);
    }
  // Buffers shared by the workers; each matmul writes its own, so that no worker overwrites what another
  // may still be reading between two barriers.
  std::vector<float> qkv(B * ldqkv), o(B * ldo), gu(B * ldgu), act(B * Fh), dn(B * lddn);
  at::Tensor logits = at::empty({B, ldv}, at::TensorOptions().dtype(at::kFloat));
  QuantBuf act_q(B, Fh);
  const bool* pp = padc.data_ptr<bool>();
  const float* x0 = x.data_ptr<float>();
  float* lp = logits.data_ptr<float>();
  // every worker's partial softmax of every head (split-K attention, merged by each worker after a barrier)
  const int threads = std::max(1, at::get_num_threads());
  std::vector<float> pm(threads * B * H), pl(threads * B * H), pacc(threads * B * H * D);

  // One team of workers for the whole step (waking threads per matmul cost more than the small matmuls
  // gained, measured). Each worker keeps its own copy of the residual stream and of the rounded inputs:
  // they are the same floats in every worker (the same operations on the same data), so only the
  // matmuls, the attention heads and the SwiGLU are split, and a barrier follows each of those.
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
  {
    const int tid = worker_id(), nt = worker_count();
    std::vector<float> xr(x0, x0 + B * E), h(B * E), ctx(B * E), qs(rep * D), kv(2 * D), work(attend_work_floats(rep, D));
    QuantBuf hq(B, E), cq(B, E);
    const auto norm_and_round = [&](const float* w) {
      for (int64_t b = 0; b < B; ++b) {
        rms_norm(xr.data() + b * E, w, eps, E, h.data() + b * E);
        hq.quantize(h.data(), b, 0, E / kBlock, level);
      }
    };
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = &weights[6 * l];
      const int64_t* k = &kinds[4 * l];
      norm_and_round(w[0].data_ptr<float>());
      tiles_share(w[1], k[0], level, hq, B, qkv.data(), ldqkv, tid, nt);
      all_workers_meet();
      // attention, split over the slots 0..s of every (row, K/V head) (split-K, see attend_range); the worker
      // whose range ends at slot s writes the new K and V there, and is the only one to read them this step
      const auto [j0, j1] = share(s + 1, tid, nt);
      for (int64_t bg = 0; bg < B * G; ++bg) {
        const int64_t b = bg / G, g = bg % G, head0 = tid * B * H + b * H + g * rep;
        const float* row = qkv.data() + b * ldqkv;
        const CacheRows K = cache_rows(k_caches[l], int8_cache ? &k_scales[l] : nullptr, b, g);
        const CacheRows Vr = cache_rows(v_caches[l], int8_cache ? &v_scales[l] : nullptr, b, g);
        if (j0 < j1 && j1 == s + 1) {
          std::memcpy(kv.data(), row + E + g * D, D * sizeof(float));
          rope_row(kv.data(), &cs[b * D], &sn[b * D], D);
          std::memcpy(kv.data() + D, row + E + KV + g * D, D * sizeof(float));
          write_cache_row(K, s, kv.data());
          write_cache_row(Vr, s, kv.data() + D);
        }
        for (int64_t i = 0; i < rep; ++i) {
          float* qh = qs.data() + i * D;
          std::memcpy(qh, row + (g * rep + i) * D, D * sizeof(float));
          rope_row(qh, &cs[b * D], &sn[b * D], D);
          for (int64_t d = 0; d < D; ++d) qh[d] *= scale;
        }
        std::fill(&pm[head0], &pm[head0] + rep, -INFINITY);
        std::fill(&pl[head0], &pl[head0] + rep, 0.0f);
        std::fill(&pacc[head0 * D], &pacc[head0 * D] + rep * D, 0.0f);
        attend_range(attend, qs.data(), rep, K, Vr, pp + b * S, j0, j1, &pm[head0], &pl[head0], &pacc[head0 * D],
                     work.data());
      }
      all_workers_meet();
      for (int64_t head = 0; head < B * H; ++head)  // every worker merges every head: no second barrier
        merge_head(nt, B * H, head, D, pm.data(), pl.data(), pacc.data(), ctx.data() + head * D);
      for (int64_t b = 0; b < B; ++b) cq.quantize(ctx.data(), b, 0, E / kBlock, level);
      tiles_share(w[2], k[1], level, cq, B, o.data(), ldo, tid, nt);
      all_workers_meet();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < E; ++i) xr[b * E + i] += o[b * ldo + i];
      norm_and_round(w[3].data_ptr<float>());
      tiles_share(w[4], k[2], level, hq, B, gu.data(), ldgu, tid, nt);  // (B, 2F): gate | up
      all_workers_meet();
      const auto [c0, c1] = share(B * (Fh / kBlock), tid, nt);  // SwiGLU and its rounding, by blocks of 32
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t b = c / (Fh / kBlock), j0 = (c % (Fh / kBlock)) * kBlock;
        for (int64_t i = j0; i < j0 + kBlock; ++i) {
          const float g = gu[b * ldgu + i];
          act[b * Fh + i] = g / (1.0f + std::exp(-g)) * gu[b * ldgu + Fh + i];
        }
        act_q.quantize(act.data(), b, j0 / kBlock, j0 / kBlock + 1, level);
      }
      all_workers_meet();
      tiles_share(w[5], k[3], level, act_q, B, dn.data(), lddn, tid, nt);
      all_workers_meet();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < E; ++i) xr[b * E + i] += dn[b * lddn + i];
    }
    norm_and_round(weights[6 * L].data_ptr<float>());
    tiles_share(weights[6 * L + 1], kinds[4 * L], level, hq, B, lp, ldv, tid, nt);
  }
  return ldv == V ? logits : logits.narrow(1, 0, V).contiguous();  // (B, V)
}

}  // namespace

TORCH_LIBRARY(attnlab_quant, m) {
  m.def("qmatmul(Tensor x, Tensor w, int kind, int in_features, int isa=-1) -> Tensor");
  m.def("dequantize(Tensor w, int kind, int in_features, int isa=-1) -> Tensor");
  m.def("cpu_isa() -> int", &cpu_isa);
  m.def("repack_tiles(Tensor w, int kind, int in_features) -> Tensor");
  m.def("dequantize_tiles(Tensor w, int kind, int in_features, Tensor rows) -> Tensor");
  m.def("qmatmul_tiles(Tensor x, Tensor w, int kind, int in_features, int out_features, int isa=-1) -> Tensor");
  m.def("quantize_x(Tensor x, int isa=-1) -> (Tensor, Tensor)");
  m.def("cpu_tile_isa() -> int", &cpu_tile_isa);
  m.def(
      "llama_decode(Tensor tok, Tensor pos, Tensor slot, Tensor pad, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "Tensor[] weights, int[] kinds, int[] dims, float eps, float rope_base, int isa=-1, Tensor[]? k_scales=None, "
      "Tensor[]? v_scales=None) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? k_scale, Tensor? v_scale, Tensor? pad, int length, "
      "float scale, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab_quant, CPU, m) {
  m.impl("qmatmul", qmatmul);
  m.impl("dequantize", dequantize);
  m.impl("repack_tiles", repack_tiles);
  m.impl("dequantize_tiles", dequantize_tiles);
  m.impl("qmatmul_tiles", qmatmul_tiles);
  m.impl("llama_decode", llama_decode);
  m.impl("decode_attention", decode_attention);
  m.impl("quantize_x", quantize_x);
}
