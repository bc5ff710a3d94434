// Attention of decode and verification rows over the caches KV policies keep, read where they are stored:
//
// - quant_attend: KIVI's packed low-bit store (speculum/cache/quantized.py) and its full-precision residual
//   window. Scores and value sums are computed from the codes, so a step reads the packed bytes (a quarter
//   or an eighth of bfloat16's) instead of a dequantized copy of the layer.
// - slot_attend: chosen slots of a float cache, one index list per KV head (speculum/cache/positioned.py,
//   attend_slots), and the step's new entries, without gathering the slots into a copy.
//
// Why hand-written: torch has no attention over packed codes, and gathering a selection costs a copy of it
// per layer and step (and memory above the cache's).
//
// Layouts (per KV head; b bits, per = 8 / b codes a byte). Codes are packed *planar*: a run of N codes
// takes N / per bytes, byte j holding codes j, j + N/per, j + 2 N/per, ... at bits 0, b, 2b, ...; so VW
// consecutive codes are VW consecutive bytes shifted alike, one widening load and one shift.
//   keys:   codes [T/G, d, G b/8] (per token group and channel, its G tokens), minimum and step
//           [T/G, d] float16: k[t, c] = lo[t/G, c] + step[t/G, c] code;
//   values: codes [T, d b/8] (per token, its d channels), minimum and step [d/Gc, T] float16 per group of
//           Gc channels: v[t, c] = lo[c/Gc, t] + step[c/Gc, t] code.
// With lanes over tokens, a key group's scores are q.lo + sum_c (q_c step_c) code_c: one broadcast
// multiply-add per channel and row over VW tokens; with lanes over channels, the value sum is
// sum_t p_t lo_t + sum_t (p_t step_t) code_t.
//
// Both kernels run one algorithm over a list of *pieces* (runs of at most SUB keys from one source: a
// quantized span, or float rows given by an index list or a contiguous range). The g query heads of a KV
// head are folded into R = g n rows (row j n + i: query i, head j of the group). Per KV head, the pieces
// are cut into tasks of about TASK keys, run in parallel (at::parallel_for), each keeping a running
// maximum, sum and unnormalised output per row (online softmax); the tasks are merged at the end. The
// cut depends on the key count only, and every row is computed by the same operations in the same order
// whatever the other rows are, so a row's result does not depend on the number of rows or threads.
// Masked keys add exact zeros (so their entries must hold finite numbers, as for torch's attention).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t SUB = 256;    // keys per piece (quantized pieces: whole groups)
constexpr int64_t TASK = 1024;  // keys per task
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// ---- vectors of VW floats ------------------------------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int VW = 16;
constexpr int MAXM = 12;  // rows per register block
constexpr int ACC = 24;   // accumulators per register block
using vf = __m512;
using vi = __m512i;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float hsum(vf a) { return _mm512_reduce_add_ps(a); }
inline float hmax(vf a) { return _mm512_reduce_max_ps(a); }

// exp of VW values <= 0 (-inf included; Cephes' expf: reduction by ln 2, degree-5 polynomial); 0 below -87.3
inline vf vexp(vf x) {
  const vf lo = vset(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const vf fx = _mm512_roundscale_ps(vmul(x, vset(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, vset(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, vset(-2.12194440e-4f), x);
  vf y = vset(1.9875691500e-4f);
  y = vfma(y, x, vset(1.3981999507e-3f));
  y = vfma(y, x, vset(8.3334519073e-3f));
  y = vfma(y, x, vset(4.1665795894e-2f));
  y = vfma(y, x, vset(1.6666665459e-1f));
  y = vfma(y, x, vset(5.0000001201e-1f));
  y = vfma(y, vmul(x, x), vadd(x, vset(1.0f)));
  const vi e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), vmul(y, _mm512_castsi512_ps(e)));
}

// a[0 .. VW) -> lane t = the sum of a[t]'s lanes (a transpose by shuffles, each lane summed in a fixed order)
inline vf reduce_lanes(const vf* a) {
  vf r8[8], r4[4];
  for (int i = 0; i < 8; ++i)
    r8[i] = vadd(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(r8[2 * j]), y = _mm512_castps_pd(r8[2 * j + 1]);
    r4[j] = vadd(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  auto fold = [](vf x, vf y) {
    return vadd(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(r4[0], r4[1]), fold(r4[2], r4[3]));
}

// Packed codes: a chunk of bytes widened to one 32-bit lane each (MODE 0: VW bytes; 1: 8 bytes and 2: 4
// bytes, repeated across the lanes), then one vector of codes per shift (lane by lane) and mask.
using vshift = vi;
inline vshift shift_lanes(const int32_t* s) { return _mm512_loadu_si512(s); }
template <int MODE>
inline vi load_chunk(const uint8_t* p) {
  if constexpr (MODE == 0) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (MODE == 1) {
    int64_t w;
    std::memcpy(&w, p, 8);
    return _mm512_cvtepu8_epi32(_mm_set1_epi64x(w));
  } else {
    int32_t w;
    std::memcpy(&w, p, 4);
    return _mm512_cvtepu8_epi32(_mm_set1_epi32(w));
  }
}
inline vf codes(vi x, vshift shift, int bits) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(x, shift), _mm512_set1_epi32((1 << bits) - 1)));
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
constexpr int MAXM = 6;
constexpr int ACC = 12;
using vf = __m256;
using vi = __m256i;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vload(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float hsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline vf vexp(vf x) {
  const vf lo = vset(-87.3f);
  const vf keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const vf fx = _mm256_round_ps(vmul(x, vset(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, vset(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, vset(-2.12194440e-4f), x);
  vf y = vset(1.9875691500e-4f);
  y = vfma(y, x, vset(1.3981999507e-3f));
  y = vfma(y, x, vset(8.3334519073e-3f));
  y = vfma(y, x, vset(4.1665795894e-2f));
  y = vfma(y, x, vset(1.6666665459e-1f));
  y = vfma(y, x, vset(5.0000001201e-1f));
  y = vfma(y, vmul(x, x), vadd(x, vset(1.0f)));
  const vi e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, vmul(y, _mm256_castsi256_ps(e)));
}

inline vf reduce_lanes(const vf* a) {
  const vf g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const vf g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return vadd(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

// as the AVX-512 code's; MODE 1 does not occur (8 bytes are a whole chunk)
using vshift = vi;
inline vshift shift_lanes(const int32_t* s) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)); }
template <int MODE>
inline vi load_chunk(const uint8_t* p) {
  if constexpr (MODE == 2) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return _mm256_cvtepu8_epi32(_mm_set1_epi32(w));
  } else {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
}
inline vf codes(vi x, vshift shift, int bits) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(x, shift), _mm256_set1_epi32((1 << bits) - 1)));
}

#else
// Portable: one float a "vector"; the same algorithm, for correctness where neither instruction set is.
constexpr int VW = 1;
constexpr int MAXM = 4;
constexpr int ACC = 8;
using vf = float;
inline vf vzero() { return 0.0f; }
inline vf vset(float x) { return x; }
inline vf vload(const float* p) { return *p; }
inline vf vload(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline vf vload(const c10::Half* p) { return static_cast<float>(*p); }
inline void vstore(float* p, vf x) { *p = x; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vfma(vf a, vf b, vf c) { return std::fma(a, b, c); }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline float hsum(vf a) { return a; }
inline float hmax(vf a) { return a; }
inline vf vexp(vf x) { return std::exp(x); }
inline vf reduce_lanes(const vf* a) { return a[0]; }

using vi = int;
using vshift = int;
inline vshift shift_lanes(const int32_t* s) { return s[0]; }
template <int MODE>
inline int load_chunk(const uint8_t* p) { return *p; }
inline vf codes(int x, vshift shift, int bits) { return static_cast<float>((x >> shift) & ((1 << bits) - 1)); }
#endif

// How a packed run of N codes (P = N b / 8 bytes, planar) is read as N / VW vectors, grouped by the chunk
// they share: chunk j (at byte off(j)) gives K vectors, vector k holding codes first(j, k) .. + VW - 1.
// MODE 0 (P a multiple of VW): chunks of VW bytes, vector k from plane k (K = 8 / b planes). MODE 1 and 2
// (P = 8 or 4 bytes, fewer than VW): the whole run repeated in one chunk, VW / P planes a vector.
struct Run {
  int mode = -1, K = 0, bits = 0;
  int64_t P = 0, chunks = 0;
  vshift shift[4];
  int64_t off(int64_t j) const { return mode == 0 ? j * VW : 0; }
  int64_t first(int64_t j, int k) const { return mode == 0 ? j * VW + k * P : k * VW; }
};

// The plan for N codes of b bits; mode -1 where the kernels do not read that layout.
inline Run plan(int64_t N, int bits) {
  Run r;
  r.bits = bits, r.P = N * bits / 8;
  const int per = 8 / bits;
  int32_t s[4][VW];
  if (N % per || N % VW) return r;
  if (r.P % VW == 0) {
    r.mode = 0, r.K = per, r.chunks = r.P / VW;
    for (int k = 0; k < per; ++k)
      for (int l = 0; l < VW; ++l) s[k][l] = bits * k;
  } else if ((r.P == 8 && VW == 16) || (r.P == 4 && VW >= 8)) {
    r.mode = r.P == 8 ? 1 : 2, r.K = static_cast<int>(N / VW), r.chunks = 1;
    for (int k = 0; k < r.K; ++k)
      for (int l = 0; l < VW; ++l) s[k][l] = bits * static_cast<int>((k * VW + l) / r.P);
  } else {
    return r;
  }
  for (int k = 0; k < r.K; ++k) r.shift[k] = shift_lanes(s[k]);
  return r;
}

template <int V>
using ic = std::integral_constant<int, V>;

// f(mode, K) with a run's mode and vectors per chunk as compile-time constants
template <typename F>
inline void with_plan(const Run& r, F&& f) {
  if (r.mode == 0) {
    if (r.K == 2) f(ic<0>{}, ic<2>{});
    else f(ic<0>{}, ic<4>{});
  } else if (r.mode == 1) {
    if constexpr (VW == 16) {
      if (r.K == 1) f(ic<1>{}, ic<1>{});
      else f(ic<1>{}, ic<2>{});
    }
  } else if constexpr (VW > 1) {
    if (r.K == 1) f(ic<2>{}, ic<1>{});
    else f(ic<2>{}, ic<2>{});
  }
}

// f(m) with m = min(rest, M) a compile-time constant
template <int M, typename F>
inline void with_rows(int64_t rest, F&& f) {
  if constexpr (M > 1) {
    if (rest >= M) return f(ic<M>{});
    return with_rows<M - 1>(rest, f);
  } else {
    f(ic<1>{});
  }
}

// f(r0, m) for blocks of rows [r0, r0 + m) of R, each row's K accumulators in registers
template <int K, typename F>
inline void row_blocks(int64_t R, F&& f) {
  constexpr int MB = std::max(1, std::min(MAXM, ACC / K));
  for (int64_t r0 = 0; r0 < R; r0 += MB)
    with_rows<MB>(R - r0, [&](auto m) { f(r0, m); });
}

// ZipCache's chunk parts: their layout and per-piece kernels; GEAR's corrections of a quantized piece
#include "zip_kernels.h"
#include "gear_kernels.h"

// ---- sources ----------------------------------------------------------------------------------------------

// A KV head's quantized store (one layer): the layouts above; T and T/G the allocated token and group counts.
struct Quant {
  const uint8_t *kc, *vc;
  const uint16_t *klo, *kst, *vlo, *vst;
  int64_t T, Tg, G, Gc, ng;
  Run krun, vrun;  // a key group's G codes (per channel), a token's d value codes
};

// Float rows: keys and values [H_kv, *, d] with strides (hs, ts) in elements; token t of a piece is
// idx[h * idx_hs + t] (an index list per head) or t itself.
struct Rows {
  const void *k, *v;
  int64_t hs, ts;
  const int64_t* idx;
  int64_t idx_hs;
};

struct Piece {
  int src;           // -1: the quantized store; -2 - i: ZipCache part i; else an index into the row sources
  int64_t a, len;    // keys a .. a + len - 1 of the source
  int64_t col;       // its first column in the concatenated key sequence (for the mask)
};

struct Problem {
  int64_t n, g, R, d, Hkv;
  const float* Q;  // [H_kv, R, d] folded rows, scaled
  Quant quant;
  std::vector<Rows> rows;
  std::vector<ZipPart> zip;
  GearTerms gear;              // the quantized store's corrections (GEAR), or none
  std::vector<Piece> pieces;
  std::vector<int64_t> tasks;  // task i: pieces tasks[i] .. tasks[i + 1] - 1
  const bool* mask;            // [Hm, n, Lm] over the last Lm columns, or null
  int64_t Hm, Lm, L;           // L: all columns
  float softcap;
  c10::ScalarType dtype;       // of the row sources
  int64_t sp;                  // scratch row stride: the longest piece, in whole vectors, and one more
};

// Per-thread scratch: scores / probabilities [R, SP], value coefficients [R, ng, SP], per-row state.
struct Scratch {
  std::vector<float> S, PS, QS, bias, alpha, los;
  std::vector<const void*> kp, vp;
  explicit Scratch(const Problem& p) {
    const int64_t SP = p.sp;
    const int64_t ng = std::max<int64_t>(1, p.quant.ng);
    S.resize(p.R * SP);
    PS.resize(p.R * ng * SP);
    QS.resize(p.R * p.d);
    bias.resize(p.R);
    alpha.resize(p.R);
    los.resize(p.R * ng);
    kp.resize(SP);
    vp.resize(SP);
  }
};

// ---- scores -------------------------------------------------------------------------------------------

// Rows r0 .. r0+M-1 over the K token vectors of chunk j of a key group (kc: its channel 0, P bytes a
// channel): S[r, t] = bias[r] + sum_c QS[r, c] code(c, t)
template <int MODE, int K, int M>
inline void quant_scores(const Run& run, int64_t j, const uint8_t* kc, int64_t d, const float* QS, const float* bias,
                         float* S, int64_t sp) {
  vf acc[M][K];
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) acc[m][k] = vset(bias[m]);
  const uint8_t* p = kc + run.off(j);
  for (int64_t c = 0; c < d; ++c, p += run.P) {
    const vi x = load_chunk<MODE>(p);
    vf v[K];
    for (int k = 0; k < K; ++k) v[k] = codes(x, run.shift[k], run.bits);
    for (int m = 0; m < M; ++m) {
      const vf b = vset(QS[m * d + c]);
      for (int k = 0; k < K; ++k) acc[m][k] = vfma(b, v[k], acc[m][k]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) vstore(S + m * sp + run.first(j, k), acc[m][k]);
}

// Rows r0 .. r0+M-1 over up to VW float keys (nt of them; the rest score 0): S[r, t] = Q[r] . k_t
template <typename T, int M>
inline void row_scores(const void* const* kp, int64_t nt, int64_t d, const float* Q, float* S, int64_t sp) {
  vf tmp[M][VW];
  for (int t = 0; t < VW; ++t) {
    vf acc[M];
    for (int m = 0; m < M; ++m) acc[m] = vzero();
    if (t < nt) {
      const T* k = static_cast<const T*>(kp[t]);
      for (int64_t c = 0; c < d; c += VW) {
        const vf x = vload(k + c);
        for (int m = 0; m < M; ++m) acc[m] = vfma(vload(Q + m * d + c), x, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) tmp[m][t] = acc[m];
  }
  for (int m = 0; m < M; ++m) vstore(S + m * sp, reduce_lanes(tmp[m]));
}

// ---- value sums ---------------------------------------------------------------------------------------

// Rows r0 .. r0+M-1, the K channel vectors of chunk j of the values (vc: token 0's codes, vbytes a token):
// O[r, c] = O[r, c] alpha[r] + los[r, grp(c)] + sum_t PS[r, grp(c), t] code(t, c), PS rows ps apart, los
// rows ng apart
template <int MODE, int K, int M>
inline void quant_values(const Run& run, int64_t j, const uint8_t* vc, int64_t vbytes, int64_t len, const float* PS,
                         int64_t ps, int64_t sp, const float* alpha, const float* los, int64_t ng, int64_t Gc, float* O,
                         int64_t d) {
  vf acc[M][K];
  const float* pk[K];
  for (int k = 0; k < K; ++k) {
    const int64_t c = run.first(j, k), grp = c / Gc;
    pk[k] = PS + grp * sp;
    for (int m = 0; m < M; ++m) acc[m][k] = vfma(vload(O + m * d + c), vset(alpha[m]), vset(los[m * ng + grp]));
  }
  const uint8_t* p = vc + run.off(j);
  for (int64_t t = 0; t < len; ++t, p += vbytes) {
    const vi x = load_chunk<MODE>(p);
    vf v[K];
    for (int k = 0; k < K; ++k) v[k] = codes(x, run.shift[k], run.bits);
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) acc[m][k] = vfma(vset(pk[k][m * ps + t]), v[k], acc[m][k]);
  }
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) vstore(O + m * d + run.first(j, k), acc[m][k]);
}

template <typename T, int M>
inline void row_values(const void* const* vp, int64_t len, int64_t c, const float* P, int64_t sp, const float* alpha,
                       float* O, int64_t d) {
  vf acc[M];
  for (int m = 0; m < M; ++m) acc[m] = vmul(vload(O + m * d), vset(alpha[m]));
  for (int64_t t = 0; t < len; ++t) {
    const vf x = vload(static_cast<const T*>(vp[t]) + c);
    for (int m = 0; m < M; ++m) acc[m] = vfma(vset(P[m * sp + t]), x, acc[m]);
  }
  for (int m = 0; m < M; ++m) vstore(O + m * d, acc[m]);
}

template <typename F>
inline void with_dtype(c10::ScalarType t, F&& f) {
  if (t == torch::kBFloat16) f(c10::BFloat16{});
  else if (t == torch::kHalf) f(c10::Half{});
  else f(float{});
}

// ---- one piece ---------------------------------------------------------------------------------------------

// QS [R, d] = q * step and bias [R] = q . lo for the rows Q [R, d]: a code's score is then QS . code + bias.
inline void scaled_queries(const float* Q, int64_t R, int64_t d, const c10::Half* lo, const c10::Half* st, Scratch& s) {
  for (int64_t r = 0; r < R; ++r) {
    vf b = vzero();
    for (int64_t c = 0; c < d; c += VW) {
      const vf qr = vload(Q + r * d + c);
      vstore(s.QS.data() + r * d + c, vmul(qr, vload(st + c)));
      b = vfma(qr, vload(lo + c), b);
    }
    s.bias[r] = hsum(b);
  }
}

void piece_scores(const Problem& p, Scratch& s, int64_t h, const Piece& pc) {
  const int64_t R = p.R, d = p.d, sp = p.sp;
  const float* Q = p.Q + h * R * d;
  if (pc.src <= -2) {
    const ZipPart& z = p.zip[-2 - pc.src];
    scaled_queries(Q, R, d, z.klo + h * d, z.kst + h * d, s);
    const uint8_t* kc = z.kc + (h * z.k + pc.a) * z.run.P;
    with_plan(z.run, [&](auto mode, auto k) {
      constexpr int MODE = decltype(mode)::value, K = decltype(k)::value;
      for (int64_t t0 = 0; t0 < pc.len; t0 += VW)
        row_blocks<1>(R, [&](int64_t r0, auto m) {
          zip_scores<MODE, K, decltype(m)::value>(z.run, kc + t0 * z.run.P, std::min<int64_t>(VW, pc.len - t0), d,
                                                  s.QS.data() + r0 * d, s.bias.data() + r0,
                                                  s.S.data() + r0 * sp + t0, sp);
        });
    });
    return;
  }
  if (pc.src < 0) {
    const Quant& q = p.quant;
    const auto* klo = reinterpret_cast<const c10::Half*>(q.klo);
    const auto* kst = reinterpret_cast<const c10::Half*>(q.kst);
    for (int64_t g0 = 0; g0 < pc.len; g0 += q.G) {
      const int64_t grp = (pc.a + g0) / q.G;
      scaled_queries(Q, R, d, klo + (h * q.Tg + grp) * d, kst + (h * q.Tg + grp) * d, s);
      const uint8_t* kc = q.kc + (h * q.Tg + grp) * d * q.krun.P;
      with_plan(q.krun, [&](auto mode, auto k) {
        constexpr int MODE = decltype(mode)::value, K = decltype(k)::value;
        for (int64_t j = 0; j < q.krun.chunks; ++j)
          row_blocks<K>(R, [&](int64_t r0, auto m) {
            quant_scores<MODE, K, decltype(m)::value>(q.krun, j, kc, d, s.QS.data() + r0 * d, s.bias.data() + r0,
                                                      s.S.data() + r0 * sp + g0, sp);
          });
      });
    }
    if (p.gear.rank || p.gear.K) gear_scores(p.gear, h, R, d, q.G, pc.a, pc.len, Q, s.S.data(), sp);
    return;
  }
  const Rows& src = p.rows[pc.src];
  with_dtype(p.dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* K = static_cast<const T*>(src.k) + h * src.hs;
    for (int64_t t = 0; t < pc.len; ++t) {
      const int64_t tok = src.idx ? src.idx[h * src.idx_hs + pc.a + t] : pc.a + t;
      s.kp[t] = K + tok * src.ts;
    }
    for (int64_t t0 = 0; t0 < pc.len; t0 += VW) {
      row_blocks<1>(R, [&](int64_t r0, auto m) {
        row_scores<T, decltype(m)::value>(s.kp.data() + t0, std::min<int64_t>(VW, pc.len - t0), d, Q + r0 * d,
                                          s.S.data() + r0 * sp + t0, sp);
      });
    }
  });
}

// Scores -> logits: soft cap, mask (-inf), -inf past the piece's end up to a whole vector.
void piece_logits(const Problem& p, Scratch& s, int64_t h, const Piece& pc) {
  const int64_t sp = p.sp, padded = (pc.len + VW - 1) / VW * VW;
  const int64_t first_masked = p.L - p.Lm;  // columns from here on are under the mask
  for (int64_t r = 0; r < p.R; ++r) {
    float* S = s.S.data() + r * sp;
    if (p.softcap > 0.0f)
      for (int64_t t = 0; t < pc.len; ++t) S[t] = std::tanh(S[t] / p.softcap) * p.softcap;
    std::fill(S + pc.len, S + padded, NEG_INF);
    if (pc.src <= -2) {  // a ZipCache part: each token's column from its map (none: all visible)
      const ZipPart& z = p.zip[-2 - pc.src];
      if (!z.cols) continue;
      const int32_t* cols = z.cols + h * z.k + pc.a;
      const bool* mk = p.mask ? p.mask + ((p.Hm == 1 ? 0 : h) * p.n + r % p.n) * p.Lm : nullptr;
      for (int64_t t = 0; t < pc.len; ++t)
        if (cols[t] < 0 || (mk && cols[t] >= first_masked && !mk[cols[t] - first_masked])) S[t] = NEG_INF;
    } else if (p.mask && pc.col + pc.len > first_masked) {
      const int64_t i = r % p.n;
      const bool* mk = p.mask + ((p.Hm == 1 ? 0 : h) * p.n + i) * p.Lm;
      for (int64_t t = std::max<int64_t>(0, first_masked - pc.col); t < pc.len; ++t)
        if (!mk[pc.col + t - first_masked]) S[t] = NEG_INF;
    }
  }
}

// Logits -> probabilities by online softmax; m, l the rows' running maximum and sum.
void piece_softmax(const Problem& p, Scratch& s, const Piece& pc, float* m, float* l) {
  const int64_t sp = p.sp, padded = (pc.len + VW - 1) / VW * VW;
  for (int64_t r = 0; r < p.R; ++r) {
    float* S = s.S.data() + r * sp;
    vf mx = vset(NEG_INF);
    for (int64_t t = 0; t < padded; t += VW) mx = vmax(mx, vload(S + t));
    const float top = hmax(mx);
    if (top == NEG_INF) {  // nothing visible here: probabilities 0, the row's state unchanged
      std::fill(S, S + padded, 0.0f);
      s.alpha[r] = 1.0f;
      continue;
    }
    const float mnew = std::max(m[r], top);
    s.alpha[r] = m[r] == NEG_INF ? 0.0f : std::exp(m[r] - mnew);
    const vf vm = vset(mnew);
    vf sum = vzero();
    for (int64_t t = 0; t < padded; t += VW) {
      const vf e = vexp(vsub(vload(S + t), vm));
      vstore(S + t, e);
      sum = vadd(sum, e);
    }
    l[r] = l[r] * s.alpha[r] + hsum(sum);
    m[r] = mnew;
  }
}

void piece_values(const Problem& p, Scratch& s, int64_t h, const Piece& pc, float* O) {
  const int64_t R = p.R, d = p.d, sp = p.sp;
  if (pc.src <= -2) {
    const ZipPart& z = p.zip[-2 - pc.src];
    // PS[r, t] = P[r, t] vstep[t], los[r] = sum_t P[r, t] vlo[t] (whole vectors, then the tail one by one: the
    // part's last tokens are its tensor's last numbers)
    const c10::Half *vlo = z.vlo + h * z.k + pc.a, *vst = z.vst + h * z.k + pc.a;
    for (int64_t r = 0; r < R; ++r) {
      const float* P = s.S.data() + r * sp;
      float* PS = s.PS.data() + r * sp;
      vf acc = vzero();
      int64_t t = 0;
      for (; t + VW <= pc.len; t += VW) {
        const vf pt = vload(P + t);
        vstore(PS + t, vmul(pt, vload(vst + t)));
        acc = vfma(pt, vload(vlo + t), acc);
      }
      float lo = hsum(acc);
      for (; t < pc.len; ++t) {
        PS[t] = P[t] * static_cast<float>(vst[t]);
        lo += P[t] * static_cast<float>(vlo[t]);
      }
      s.los[r] = lo;
    }
    const uint8_t* vc = z.vc + (h * z.k + pc.a) * z.run.P;
    with_plan(z.run, [&](auto mode, auto k) {
      constexpr int MODE = decltype(mode)::value, K = decltype(k)::value;
      for (int64_t j = 0; j < z.run.chunks; ++j)
        row_blocks<K>(R, [&](int64_t r0, auto m) {
          zip_values<MODE, K, decltype(m)::value>(z.run, j, vc, pc.len, s.PS.data() + r0 * sp, sp,
                                                  s.los.data() + r0, s.alpha.data() + r0, z.vscale + h * d,
                                                  O + r0 * d, d);
        });
    });
    return;
  }
  if (pc.src < 0) {
    const Quant& q = p.quant;
    const int64_t ng = q.ng;
    // per channel group: PS[r, grp, t] = P[r, t] step[grp, t], los[r, grp] = sum_t P[r, t] lo[grp, t]
    const auto* vlo = reinterpret_cast<const c10::Half*>(q.vlo) + h * ng * q.T + pc.a;
    const auto* vst = reinterpret_cast<const c10::Half*>(q.vst) + h * ng * q.T + pc.a;
    for (int64_t r = 0; r < R; ++r) {
      const float* P = s.S.data() + r * sp;
      for (int64_t grp = 0; grp < ng; ++grp) {
        float* PS = s.PS.data() + (r * ng + grp) * sp;
        vf acc = vzero();
        for (int64_t t = 0; t < pc.len; t += VW) {
          const vf pt = vload(P + t);
          vstore(PS + t, vmul(pt, vload(vst + grp * q.T + t)));
          acc = vfma(pt, vload(vlo + grp * q.T + t), acc);
        }
        s.los[r * ng + grp] = hsum(acc);
      }
    }
    const uint8_t* vc = q.vc + (h * q.T + pc.a) * q.vrun.P;
    with_plan(q.vrun, [&](auto mode, auto k) {
      constexpr int MODE = decltype(mode)::value, K = decltype(k)::value;
      for (int64_t j = 0; j < q.vrun.chunks; ++j)
        row_blocks<K>(R, [&](int64_t r0, auto m) {
          quant_values<MODE, K, decltype(m)::value>(q.vrun, j, vc, q.vrun.P, pc.len, s.PS.data() + r0 * ng * sp,
                                                    ng * sp, sp, s.alpha.data() + r0, s.los.data() + r0 * ng, ng,
                                                    q.Gc, O + r0 * d, d);
        });
    });
    if (p.gear.rank || p.gear.K) gear_values(p.gear, h, R, d, q.G, pc.a, pc.len, s.S.data(), sp, O);
    return;
  }
  const Rows& src = p.rows[pc.src];
  with_dtype(p.dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* V = static_cast<const T*>(src.v) + h * src.hs;
    for (int64_t t = 0; t < pc.len; ++t) {
      const int64_t tok = src.idx ? src.idx[h * src.idx_hs + pc.a + t] : pc.a + t;
      s.vp[t] = V + tok * src.ts;
    }
    for (int64_t c = 0; c < d; c += VW) {
      row_blocks<1>(R, [&](int64_t r0, auto m) {
        row_values<T, decltype(m)::value>(s.vp.data(), pc.len, c, s.S.data() + r0 * sp, sp, s.alpha.data() + r0,
                                          O + r0 * d + c, d);
      });
    }
  });
}

// ---- the whole call ----------------------------------------------------------------------------------------

void add_pieces(Problem& p, int src, int64_t a, int64_t b, int64_t step) {
  for (int64_t x = a; x < b; x += step) {
    const int64_t len = std::min(step, b - x);
    p.pieces.push_back(Piece{src, x, len, p.L});
    p.L += len;
  }
}

// a piece's source, ZipCache's parts as one
inline int kind(int src) { return src <= -2 ? -2 : src; }

// tasks of consecutive pieces, about TASK keys each, a new task at each change of source (ZipCache's parts: one)
void cut_tasks(Problem& p) {
  p.tasks.clear();
  int64_t keys = 0;
  for (size_t i = 0; i < p.pieces.size(); ++i) {
    if (i == 0 || keys + p.pieces[i].len > TASK || kind(p.pieces[i].src) != kind(p.pieces[i - 1].src)) {
      p.tasks.push_back(static_cast<int64_t>(i));
      keys = 0;
    }
    keys += p.pieces[i].len;
  }
  p.tasks.push_back(static_cast<int64_t>(p.pieces.size()));
}

// Folded, scaled queries: q [n, H, d] -> [H_kv, g n, d] float32.
torch::Tensor fold(const torch::Tensor& q, int64_t Hkv, double scale) {
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), g = H / Hkv;
  return (q.to(torch::kFloat32) * scale).view({n, Hkv, g, d}).permute({1, 2, 0, 3}).contiguous().view({Hkv, g * n, d});
}

// The tasks, the folded queries (returned: p.Q points into them) and the scratch stride.
torch::Tensor prepare(Problem& p, const torch::Tensor& q, double scale) {
  cut_tasks(p);
  torch::Tensor folded = fold(q, p.Hkv, scale);
  p.Q = folded.data_ptr<float>();
  p.sp = 0;
  for (const Piece& pc : p.pieces) p.sp = std::max(p.sp, (pc.len + VW - 1) / VW * VW + VW);
  return folded;
}

torch::Tensor run(Problem& p, const torch::Tensor& q, double scale) {
  const torch::Tensor folded = prepare(p, q, scale);
  const int64_t ntask = static_cast<int64_t>(p.tasks.size()) - 1, R = p.R, d = p.d, H = p.Hkv * p.g;
  auto out = torch::zeros({p.n, H * d}, q.options().dtype(torch::kFloat32));
  if (ntask <= 0) return out.to(q.scalar_type());
  std::vector<float> pm(p.Hkv * ntask * R, NEG_INF), pl(p.Hkv * ntask * R, 0.0f), po(p.Hkv * ntask * R * d, 0.0f);
  at::parallel_for(0, p.Hkv * ntask, 1, [&](int64_t begin, int64_t end) {
    Scratch s(p);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / ntask, task = item % ntask;
      float *m = pm.data() + item * R, *l = pl.data() + item * R, *O = po.data() + item * R * d;
      for (int64_t i = p.tasks[task]; i < p.tasks[task + 1]; ++i) {
        const Piece& pc = p.pieces[i];
        piece_scores(p, s, h, pc);
        piece_logits(p, s, h, pc);
        piece_softmax(p, s, pc, m, l);
        piece_values(p, s, h, pc, O);
      }
    }
  });
  // merge the tasks of each (KV head, row) and unfold: row j n + i of KV head kv -> query i, head kv g + j
  // (little work: on this thread, sparing a second wait for the pool)
  float* Y = out.data_ptr<float>();
  for (int64_t item = 0; item < p.Hkv * R; ++item) {
    const int64_t kv = item / R, r = item % R, j = r / p.n, i = r % p.n;
    float top = NEG_INF;
    for (int64_t t = 0; t < ntask; ++t) top = std::max(top, pm[(kv * ntask + t) * R + r]);
    if (top == NEG_INF) continue;  // no visible key: zeros
    float* y = Y + i * H * d + (kv * p.g + j) * d;
    float total = 0.0f;
    for (int64_t t = 0; t < ntask; ++t) {
      const int64_t at = (kv * ntask + t) * R + r;
      if (pm[at] == NEG_INF) continue;
      const float w = std::exp(pm[at] - top);
      total += pl[at] * w;
      const float* o = po.data() + at * d;
      for (int64_t c = 0; c < d; ++c) y[c] += w * o[c];
    }
    const float inv = 1.0f / total;
    for (int64_t c = 0; c < d; ++c) y[c] *= inv;
  }
  return out.to(q.scalar_type());
}

// Every piece's logits (piece_scores, then piece_logits' cap and mask) written out rather than attended:
// float32 [H_kv, R, L], rows folded. (slot_scores.)
torch::Tensor logits_table(Problem& p, const torch::Tensor& q, double scale) {
  const torch::Tensor folded = prepare(p, q, scale);  // p reads the folded queries: kept alive to the end
  const int64_t ntask = static_cast<int64_t>(p.tasks.size()) - 1, R = p.R, L = p.L, Hkv = p.Hkv;
  auto out = torch::empty({Hkv, R, L}, q.options().dtype(torch::kFloat32));
  float* Y = out.data_ptr<float>();
  at::parallel_for(0, Hkv * std::max<int64_t>(ntask, 0), 1, [&](int64_t begin, int64_t end) {
    Scratch s(p);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / ntask, task = item % ntask;
      for (int64_t i = p.tasks[task]; i < p.tasks[task + 1]; ++i) {
        const Piece& pc = p.pieces[i];
        piece_scores(p, s, h, pc);
        piece_logits(p, s, h, pc);
        for (int64_t r = 0; r < R; ++r)
          std::copy(s.S.data() + r * p.sp, s.S.data() + r * p.sp + pc.len, Y + (h * R + r) * L + pc.col);
      }
    }
  });
  return out;
}

void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// q [n, H, d]; a mask [1 | H_kv, n, Lm] bool (or an empty tensor) over the last Lm columns
Problem make_problem(const torch::Tensor& q, int64_t Hkv, const torch::Tensor& mask) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be [n, H, d]");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "the query heads must be a multiple of the KV heads");
  TORCH_CHECK(d % VW == 0, "the head dim must be a multiple of ", VW);
  Problem p{};
  p.n = n, p.g = H / Hkv, p.R = p.g * n, p.d = d, p.Hkv = Hkv;
  p.mask = nullptr, p.Hm = 1, p.Lm = 0, p.L = 0;
  if (mask.numel() > 0) {
    check_cpu(mask, "mask");
    TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.dim() == 3 &&
                    (mask.size(0) == 1 || mask.size(0) == Hkv) && mask.size(1) == n,
                "mask must be a contiguous bool [1 or H_kv, n, Lm]");
    p.mask = mask.data_ptr<bool>(), p.Hm = mask.size(0), p.Lm = mask.size(2);
  }
  return p;
}

Rows rows_of(const torch::Tensor& k, const torch::Tensor& v, int64_t Hkv, int64_t d) {
  check_cpu(k, "keys");
  TORCH_CHECK(k.dim() == 3 && k.size(0) == Hkv && k.size(2) == d && v.sizes() == k.sizes() && k.stride(2) == 1 &&
                  v.strides() == k.strides() && k.scalar_type() == v.scalar_type(),
              "keys and values must be [H_kv, *, d] alike, channels contiguous");
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16 ||
                  k.scalar_type() == torch::kHalf, "keys and values must be float32, bfloat16 or float16");
  return Rows{k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), nullptr, 0};
}

}  // namespace

// One layer's quantized store (the operands below) as a source for slots start .. tq - 1 (tq > start), checked.
static Quant quant_of(const torch::Tensor& kcodes, const torch::Tensor& klo, const torch::Tensor& kstep,
               const torch::Tensor& vcodes, const torch::Tensor& vlo, const torch::Tensor& vstep, int64_t bits,
               int64_t start, int64_t tq, int64_t Hkv, int64_t d) {
  TORCH_CHECK(bits == 2 || bits == 4, "2 or 4 bits");
  for (const auto* t : {&kcodes, &klo, &kstep, &vcodes, &vlo, &vstep}) {
    check_cpu(*t, "the quantized store");
    TORCH_CHECK(t->is_contiguous() && t->dim() >= 1 && t->size(0) == Hkv,
                "the quantized store must be contiguous, [H_kv, ...]");
  }
  TORCH_CHECK(kcodes.scalar_type() == torch::kUInt8 && vcodes.scalar_type() == torch::kUInt8, "codes must be uint8");
  for (const auto* t : {&klo, &kstep, &vlo, &vstep})
    TORCH_CHECK(t->scalar_type() == torch::kHalf, "minima and steps must be float16");
  TORCH_CHECK(kcodes.dim() == 4 && vcodes.dim() == 3 && vlo.dim() == 3, "keys: [H_kv, T/G, d, G b/8] codes, values: "
              "[H_kv, T, d b/8] codes and [H_kv, d/Gc, T] minima");
  const int64_t per = 8 / bits, Tg = kcodes.size(1), G = kcodes.size(3) * per, T = vcodes.size(1);
  const int64_t ng = vlo.size(1), Gc = d / std::max<int64_t>(1, ng);
  TORCH_CHECK(kcodes.size(2) == d && klo.dim() == 3 && klo.size(1) == Tg && klo.size(2) == d &&
                  kstep.sizes() == klo.sizes(), "keys: shapes");
  TORCH_CHECK(vcodes.size(2) * per == d && vlo.size(2) == T && vstep.sizes() == vlo.sizes() && ng * Gc == d,
              "values: shapes");
  const Run krun = plan(G, static_cast<int>(bits)), vrun = plan(d, static_cast<int>(bits));
  TORCH_CHECK(krun.mode >= 0 && vrun.mode >= 0 && Gc % VW == 0, "this build does not read ", bits,
              "-bit codes in groups of ", G, " tokens, ", Gc, " channels, head dim ", d, " (see reads_packed)");
  TORCH_CHECK(start % G == 0 && tq % G == 0 && 0 <= start && tq <= Tg * G && tq <= T, "quantized slots out of range");
  return Quant{kcodes.data_ptr<uint8_t>(), vcodes.data_ptr<uint8_t>(),
               reinterpret_cast<const uint16_t*>(klo.data_ptr()), reinterpret_cast<const uint16_t*>(kstep.data_ptr()),
               reinterpret_cast<const uint16_t*>(vlo.data_ptr()), reinterpret_cast<const uint16_t*>(vstep.data_ptr()),
               T, Tg, G, Gc, ng, krun, vrun};
}

// pieces of the quantized slots start .. tq - 1: whole groups, about SUB keys each
static void add_quant_pieces(Problem& p, int64_t start, int64_t tq) {
  add_pieces(p, -1, start, tq, std::max<int64_t>(1, SUB / p.quant.G) * p.quant.G);
}

// Attention of q [n, H, d] over one layer's quantized slots start .. tq - 1 (multiples of G) followed by the
// float rows rk, rv [H_kv, Lr, d] (the residual window, the step's entries last); mask as make_problem's over
// those tq - start + Lr columns; softcap 0 for none. The quantized operands are the layer's: kcodes
// [H_kv, T/G, d, G b/8], klo, kstep [H_kv, T/G, d], vcodes [H_kv, T, d b/8], vlo, vstep [H_kv, d/Gc, T]
// (float16, contiguous). -> [n, H d] in q's dtype.
// quant_attend's problem (the quantized slots' pieces, then the float rows'), for it and gear_attend.
Problem quant_problem(const torch::Tensor& q, const torch::Tensor& kcodes, const torch::Tensor& klo,
                      const torch::Tensor& kstep, const torch::Tensor& vcodes, const torch::Tensor& vlo,
                      const torch::Tensor& vstep, int64_t bits, int64_t start, int64_t tq, const torch::Tensor& rk,
                      const torch::Tensor& rv, const torch::Tensor& mask, double softcap) {
  const int64_t Hkv = rk.size(0), d = q.size(-1);
  Problem p = make_problem(q, Hkv, mask);
  p.rows.push_back(rows_of(rk, rv, Hkv, d));
  p.dtype = rk.scalar_type();
  p.softcap = static_cast<float>(softcap);
  p.quant = Quant{};
  if (tq > start) {
    p.quant = quant_of(kcodes, klo, kstep, vcodes, vlo, vstep, bits, start, tq, Hkv, d);
    add_quant_pieces(p, start, tq);
  }
  add_pieces(p, 0, 0, rk.size(1), SUB);
  TORCH_CHECK(p.Lm <= p.L, "the mask has more columns than there are keys");
  return p;
}

torch::Tensor quant_attend(torch::Tensor q, torch::Tensor kcodes, torch::Tensor klo, torch::Tensor kstep,
                           torch::Tensor vcodes, torch::Tensor vlo, torch::Tensor vstep, int64_t bits, int64_t start,
                           int64_t tq, torch::Tensor rk, torch::Tensor rv, torch::Tensor mask, double scale,
                           double softcap) {
  Problem p = quant_problem(q, kcodes, klo, kstep, vcodes, vlo, vstep, bits, start, tq, rk, rv, mask, softcap);
  return run(p, q, scale);
}

// Attention of q [n, H, d] over chosen slots of one layer's float cache k, v [H_kv, C, d] read in place:
// slots [H_kv, m] int64 per KV head (None: slots start .. length - 1), then slots length .. length + fresh
// - 1 (the step's new entries); mask as make_problem's over those m + fresh columns; softcap 0 for none.
// -> [n, H d] in q's dtype.
torch::Tensor slot_attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::optional<torch::Tensor> slots,
                          int64_t start, int64_t length, int64_t fresh, torch::Tensor mask, double scale,
                          double softcap) {
  const int64_t Hkv = k.size(0), d = q.size(-1);
  Problem p = make_problem(q, Hkv, mask);
  Rows rows = rows_of(k, v, Hkv, d);
  p.dtype = k.scalar_type();
  p.softcap = static_cast<float>(softcap);
  p.quant = Quant{};
  TORCH_CHECK(length >= 0 && fresh >= 0 && length + fresh <= k.size(1), "slots out of range");
  torch::Tensor idx;
  if (slots.has_value()) {
    idx = slots->to(torch::kInt64).contiguous();
    check_cpu(idx, "slots");
    TORCH_CHECK(idx.dim() == 2 && idx.size(0) == Hkv, "slots must be [H_kv, m]");
    if (idx.numel() > 0)
      TORCH_CHECK(idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < length, "a slot out of range");
    Rows chosen = rows;
    chosen.idx = idx.data_ptr<int64_t>(), chosen.idx_hs = idx.size(1);
    p.rows.push_back(chosen);
    add_pieces(p, 0, 0, idx.size(1), SUB);
  } else {
    TORCH_CHECK(0 <= start && start <= length, "start out of range");
    p.rows.push_back(rows);
    add_pieces(p, 0, start, length, SUB);
  }
  p.rows.push_back(rows);
  add_pieces(p, 1, length, length + fresh, SUB);
  // a fresh piece's columns continue the chosen ones: add_pieces numbers columns in order
  TORCH_CHECK(p.Lm <= p.L, "the mask has more columns than there are keys");
  return run(p, q, scale);
}

// quant_attend over GEAR's store (speculum/cache/gear.py): the codes plus, in the same pass, the low-rank terms
// and outliers (gear_kernels.h) of one layer. fa [2, H_kv, r, T_cap] float16 left factors by slot (transposed),
// fb [2, H_kv, C_cap, r, d] float16 right factors by chunk, chunk_of [T_cap / G] int64 each group's chunk, the
// slots read lying in chunks c0 .. c1 - 1; oidx [2, H_kv, K_cap] int32 the outliers' flat indices in their
// chunk, increasing over the first K (in chunk order, each chunk's sorted), obase [K_cap] int32 their chunk's
// first flat index, odelta [2, H_kv, K_cap] float32 their corrections. -> [n, H d] in q's dtype.
torch::Tensor gear_attend(torch::Tensor q, torch::Tensor kcodes, torch::Tensor klo, torch::Tensor kstep,
                          torch::Tensor vcodes, torch::Tensor vlo, torch::Tensor vstep, int64_t bits, int64_t start,
                          int64_t tq, torch::Tensor rk, torch::Tensor rv, torch::Tensor mask, double scale,
                          double softcap, torch::Tensor fa, torch::Tensor fb, torch::Tensor chunk_of, int64_t c0,
                          int64_t c1, torch::Tensor oidx, torch::Tensor obase, torch::Tensor odelta, int64_t K) {
  const int64_t Hkv = rk.size(0), d = q.size(-1);
  Problem p = quant_problem(q, kcodes, klo, kstep, vcodes, vlo, vstep, bits, start, tq, rk, rv, mask, softcap);
  if (tq > start) {
    for (const auto* t : {&fa, &fb, &chunk_of, &oidx, &obase, &odelta}) {
      check_cpu(*t, "GEAR's terms");
      TORCH_CHECK(t->is_contiguous(), "GEAR's terms must be contiguous");
    }
    TORCH_CHECK(fa.scalar_type() == torch::kHalf && fb.scalar_type() == torch::kHalf &&
                    chunk_of.scalar_type() == torch::kInt64 && oidx.scalar_type() == torch::kInt32 &&
                    obase.scalar_type() == torch::kInt32 && odelta.scalar_type() == torch::kFloat32,
                "GEAR's terms: factors float16, chunks int64, outlier indices int32, corrections float32");
    TORCH_CHECK(fa.dim() == 4 && fa.size(0) == 2 && fa.size(1) == Hkv && fa.size(2) <= 64 && fa.size(3) >= tq &&
                    fb.dim() == 5 && fb.size(0) == 2 && fb.size(1) == Hkv && fb.size(3) == fa.size(2) &&
                    fb.size(4) == d && chunk_of.dim() == 1 && chunk_of.size(0) * p.quant.G >= tq,
                "GEAR's factors: [2, H_kv, r <= 64, T_cap] and [2, H_kv, C_cap, r, d], chunk_of [T_cap / G]");
    TORCH_CHECK(0 <= c0 && c0 < c1 && c1 <= fb.size(2), "chunks out of range");
    TORCH_CHECK(oidx.dim() == 3 && oidx.size(0) == 2 && oidx.size(1) == Hkv && odelta.sizes() == oidx.sizes() &&
                    obase.dim() == 1 && obase.size(0) == oidx.size(2) && 0 <= K && K <= oidx.size(2),
                "GEAR's outliers: [2, H_kv, K_cap] indices and corrections, [K_cap] bases, K <= K_cap");
    GearTerms& g = p.gear;
    g.rank = fa.size(2), g.Tcap = fa.size(3), g.Ccap = fb.size(2), g.c0 = c0, g.C = c1 - c0;
    g.which = chunk_of.data_ptr<int64_t>();
    for (int64_t grp = start / p.quant.G; grp < tq / p.quant.G; ++grp)
      TORCH_CHECK(c0 <= g.which[grp] && g.which[grp] < c1, "a group's chunk out of range");
    g.K = K, g.Kcap = oidx.size(2), g.base = obase.data_ptr<int32_t>();
    g.dshift = (d & (d - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(d)) : -1;
    for (int kind = 0; kind < 2; ++kind) {
      g.a[kind] = reinterpret_cast<const c10::Half*>(fa.data_ptr()) + kind * Hkv * g.rank * g.Tcap;
      g.b[kind] = reinterpret_cast<const c10::Half*>(fb.data_ptr()) + kind * Hkv * g.Ccap * g.rank * d;
      g.idx[kind] = oidx.data_ptr<int32_t>() + kind * Hkv * g.Kcap;
      g.delta[kind] = odelta.data_ptr<float>() + kind * Hkv * g.Kcap;
    }
    if (g.rank) {  // q . B of the keys' chunks, per folded row
      const torch::Tensor folded = fold(q, Hkv, scale);
      const float* Q = folded.data_ptr<float>();
      const int64_t R = p.R;
      g.qb.assign(Hkv * R * g.C * g.rank, 0.0f);
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < g.C; ++c)
            for (int64_t k = 0; k < g.rank; ++k) {
              const c10::Half* B = g.b[0] + ((h * g.Ccap + c0 + c) * g.rank + k) * d;
              vf acc = vzero();
              for (int64_t x = 0; x < d; x += VW) acc = vfma(vload(Q + (h * R + r) * d + x), vload(B + x), acc);
              g.qb[((h * R + r) * g.C + c) * g.rank + k] = hsum(acc);
            }
    }
  }
  return run(p, q, scale);
}

// Attention of q [n, H, d] over one layer of a ZipCache store (speculum/cache/mixed.py), its chunks' parts read
// as stored (zip_kernels.h), followed by the float rows rk, rv [H_kv, Lr, d] (the residual window, the step's
// entries last); mask as quant_attend's over the tq - start + Lr columns, the store's in slot order (start ..
// tq - 1); softcap 0 for none. parts: 8 tensors per part, each [layers, H_kv, ...] contiguous: key codes
// [.., k, d b/8] uint8, minimum and step [.., 1, d] float16, value codes [.., k, d b/8] uint8, minimum and step
// [.., k, 1] float16, the chunk's value channel scales [.., d] float16 and salient flags [.., t] bool; meta: 3
// numbers per part (bits, the chunk's first slot, 1 for its salient part or 0). A chunk may start before start
// (its earlier tokens are not read) but must end by tq. -> [n, H d] in q's dtype.
torch::Tensor zip_attend(torch::Tensor q, std::vector<torch::Tensor> parts, std::vector<int64_t> meta, int64_t layer,
                         int64_t start, int64_t tq, torch::Tensor rk, torch::Tensor rv, torch::Tensor mask, double scale,
                         double softcap) {
  const int64_t Hkv = rk.size(0), d = q.size(-1), Lr = rk.size(1), np = static_cast<int64_t>(meta.size()) / 3;
  Problem p = make_problem(q, Hkv, mask);
  p.rows.push_back(rows_of(rk, rv, Hkv, d));
  p.dtype = rk.scalar_type();
  p.softcap = static_cast<float>(softcap);
  p.quant = Quant{};
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == 8 * np && static_cast<int64_t>(meta.size()) == 3 * np,
              "zip_attend takes 8 tensors and 3 numbers per part");
  TORCH_CHECK(0 <= start && start <= tq, "start out of range");
  const int64_t Lq = tq - start, first_masked = Lq + Lr - p.Lm;
  TORCH_CHECK(first_masked >= 0, "the mask has more columns than there are keys");
  // columns need a map where a chunk starts before start or the mask hides a column of the store
  bool need = false;
  for (int64_t i = 0; i < np; ++i) need |= meta[3 * i + 1] < start;
  for (int64_t x = 0; p.mask && !need && x < p.Hm * p.n; ++x)
    for (int64_t c = 0; c < Lq - first_masked; ++c)
      if (!p.mask[x * p.Lm + c]) {
        need = true;
        break;
      }
  std::vector<std::vector<int32_t>> cols(np);
  for (int64_t i = 0; i < np; ++i) {
    const torch::Tensor* t = parts.data() + 8 * i;
    const int64_t bits = meta[3 * i], cstart = meta[3 * i + 1];
    const bool hi = meta[3 * i + 2] != 0;
    for (int j = 0; j < 8; ++j) {
      check_cpu(t[j], "a ZipCache part");
      TORCH_CHECK(t[j].is_contiguous() && t[j].dim() >= 3 && t[j].size(1) == Hkv && t[j].size(0) == t[0].size(0),
                  "a ZipCache part's tensors must be contiguous [layers, H_kv, ...]");
    }
    TORCH_CHECK(0 <= layer && layer < t[0].size(0), "layer out of range");
    TORCH_CHECK(bits == 2 || bits == 4, "2 or 4 bits");
    const int64_t k = t[0].size(2), P = d * bits / 8, T = t[7].size(2);
    TORCH_CHECK(t[0].scalar_type() == torch::kUInt8 && t[3].scalar_type() == torch::kUInt8 &&
                    t[7].scalar_type() == torch::kBool, "codes must be uint8, salient flags bool");
    for (int j : {1, 2, 4, 5, 6}) TORCH_CHECK(t[j].scalar_type() == torch::kHalf, "minima, steps and scales: float16");
    TORCH_CHECK(t[0].dim() == 4 && t[0].size(3) == P && t[3].sizes() == t[0].sizes() && t[1].dim() == 4 &&
                    t[1].size(2) == 1 && t[1].size(3) == d && t[2].sizes() == t[1].sizes() && t[4].dim() == 4 &&
                    t[4].size(2) == k && t[4].size(3) == 1 && t[5].sizes() == t[4].sizes() && t[6].dim() == 3 &&
                    t[6].size(2) == d && t[7].dim() == 3 && k <= T,
                "a ZipCache part's shapes: codes [.., k, d b/8], key ranges [.., 1, d], value ranges [.., k, 1], "
                "scales [.., d], flags [.., t]");
    TORCH_CHECK(cstart >= 0 && cstart + T <= tq, "a chunk past the store's end");
    const Run zrun = plan(d, static_cast<int>(bits));
    TORCH_CHECK(zrun.mode >= 0, "this build does not read ", bits, "-bit codes of head dim ", d, " (see reads_packed)");
    auto at = [&](int j) { return static_cast<const char*>(t[j].data_ptr()) + layer * t[j].stride(0) * t[j].element_size(); };
    auto half = [&](int j) { return reinterpret_cast<const c10::Half*>(at(j)); };
    ZipPart z{reinterpret_cast<const uint8_t*>(at(0)), reinterpret_cast<const uint8_t*>(at(3)), half(1), half(2),
              half(4), half(5), half(6), k, zrun, nullptr};
    if (need) {  // token j of the part: the j-th slot of the chunk whose flag says this part
      cols[i].resize(Hkv * k);
      const bool* flags = reinterpret_cast<const bool*>(at(7));
      for (int64_t h = 0; h < Hkv; ++h) {
        int64_t j = 0;
        for (int64_t u = 0; u < T; ++u)
          if (flags[h * T + u] == hi) {
            TORCH_CHECK(j < k, "a ZipCache part holds fewer tokens than its flags say");
            cols[i][h * k + j++] = static_cast<int32_t>(cstart + u - start);
          }
        TORCH_CHECK(j == k, "a ZipCache part holds more tokens than its flags say");
      }
      z.cols = cols[i].data();
    }
    p.zip.push_back(z);
    for (int64_t x = 0; x < k; x += SUB) p.pieces.push_back(Piece{static_cast<int>(-2 - i), x, std::min(SUB, k - x), -1});
  }
  p.L = Lq;  // the window's columns follow the store's
  add_pieces(p, 0, 0, Lr, SUB);
  TORCH_CHECK(p.Lm <= p.L, "the mask has more columns than there are keys");
  return run(p, q, scale);
}

// Whether this build reads N codes of b bits packed as a run (key groups: N = G; values: N = d, with
// channel groups of a whole number of vectors).
bool reads_packed(int64_t N, int64_t bits) {
  return (bits == 2 || bits == 4) && plan(N, static_cast<int>(bits)).mode >= 0;
}

// The attention logits (scaled, soft-capped, -inf where the mask hides) of q [n, H, d] over slots of one
// layer's float cache k [H_kv, C, d], read in place: slots [H_kv, m] per KV head, or (None) slots start ..
// length - 1; mask as make_problem's over those columns. -> float32 [H_kv, g n, columns], rows folded (what
// a policy scoring tokens by attention softmaxes, without a contiguous copy of the keys).
torch::Tensor slot_scores(torch::Tensor q, torch::Tensor k, std::optional<torch::Tensor> slots, int64_t start,
                          int64_t length, torch::Tensor mask, double scale, double softcap) {
  const int64_t Hkv = k.size(0), d = q.size(-1);
  Problem p = make_problem(q, Hkv, mask);
  Rows rows = rows_of(k, k, Hkv, d);
  p.dtype = k.scalar_type();
  p.softcap = static_cast<float>(softcap);
  p.quant = Quant{};
  TORCH_CHECK(0 <= start && start <= length && length <= k.size(1), "slots out of range");
  torch::Tensor idx;
  if (slots.has_value()) {
    idx = slots->to(torch::kInt64).contiguous();
    TORCH_CHECK(idx.dim() == 2 && idx.size(0) == Hkv, "slots must be [H_kv, m]");
    if (idx.numel() > 0)
      TORCH_CHECK(idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < length, "a slot out of range");
    rows.idx = idx.data_ptr<int64_t>(), rows.idx_hs = idx.size(1);
    p.rows.push_back(rows);
    add_pieces(p, 0, 0, idx.size(1), SUB);
  } else {
    p.rows.push_back(rows);
    add_pieces(p, 0, start, length, SUB);
  }
  TORCH_CHECK(p.Lm <= p.L, "the mask has more columns than there are keys");
  return logits_table(p, q, scale);
}

// The instruction set this build uses.
std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_attend", &quant_attend, "attention over a KIVI packed low-bit store and its float residual window");
  m.def("slot_attend", &slot_attend, "attention over chosen slots of a float cache, read in place, and the new entries");
  m.def("slot_scores", &slot_scores, "attention logits over chosen or all slots of a float cache, read in place");
  m.def("gear_attend", &gear_attend, "attention over GEAR's store: KIVI's codes, low-rank terms and outliers in one pass");
  m.def("zip_attend", &zip_attend, "attention over a ZipCache mixed-precision store, read as stored, and a float window");
  m.def("isa", &isa, "instruction set of this build");
  m.def("reads_packed", &reads_packed, "whether this build reads a packed run of N b-bit codes");
  m.attr("vector_width") = VW;
}
