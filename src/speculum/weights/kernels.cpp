// Matrix products on block-quantized weights for 1 to a few dozen rows (decoding and verification).
//
// Why hand-written: torch's weight-only CPU kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm)
// run slower than a float32 F.linear on AVX2 machines, and none of them reads GGUF's formats.
//
// Two weight layouts, each the exact values of the GGUF formats mapped onto it (speculum/weights/formats.py):
//   u4: unsigned 4-bit codes q in 0..15, two per byte (byte i of a 32-block holds element i in its low
//       nibble and element i + 16 in its high one), w = scale * q + offset per block of 32
//       (Q4_0, Q4_1, Q4_K);
//   s8: signed 8-bit codes, w = scale * q per block of `bs` (32 or 16) elements (Q8_0, Q5_0, Q6_K).
// Scales and offsets are float16 (`half`) where the source format's are, else float32.
//
// qlinear keeps the activations float32: each weight block is decoded to floats in registers
// (w = scale * q + offset, one fused multiply-add) and multiplied into every activation row of the tile, so
// a step over several rows reads each weight block once per tile of rows. A product equals the product
// with the dequantized weights up to float32 rounding. qlinear8 rounds the activations to 8 bits per
// block of 32 first, as llama.cpp does, and multiplies codes in integers (fewer instructions per weight,
// but not faster where a product waits on memory; see the note above it). Each row of the output is
// computed by the same instructions in the same order whatever the number of rows in the call, so a row's
// result does not depend on the others.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t QB = 32;  // block of the u4 layout's offsets

inline float to_float(float v) { return v; }

// Asks for the same chunk of a row a few tiles on (prefetch_rows: at least PREFETCH_BYTES ahead) while this
// tile computes: the hardware prefetchers follow one stream per weight row poorly, and a product over few
// activation rows is bound by how fast its weights arrive.
constexpr int64_t PREFETCH_BYTES = 8192;
inline void prefetch_next(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
inline int64_t prefetch_rows(int64_t W, int64_t row_bytes) {
  return W * std::max<int64_t>(1, (PREFETCH_BYTES + W * row_bytes - 1) / (W * row_bytes));
}
inline float to_float(uint16_t h) {  // exact either way; the F16C instruction is one, the portable code dozens
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// A tile is WR weight rows (o0 ..) against M activation rows (r0 ..): WR * M independent accumulators,
// one per output, each summed over the chunks in order, then reduced once.
#if defined(__AVX512F__) && defined(__AVX512BW__)

// tile shapes: few activation rows take more weight rows (independent sums), many take more activation
// rows per decoded weight block (WIDE_M), within 32 vector registers
constexpr int NARROW_W = 4, NARROW_M = 2, WIDE_W = 2, WIDE_M = 8;

// 16 codes from p as floats: u4 takes the low (hi = false) or high nibbles of 16 bytes, s8 16 signed bytes
template <bool U4>
inline __m512 codes16(const uint8_t* p, bool hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (U4) {
    const __m128i q = hi ? _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)) : _mm_and_si128(b, _mm_set1_epi8(0x0F));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
}

// A chunk is one block of 32 elements: two vectors of 16.
template <bool U4, typename S, int W, int M>
void tile_dot(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wo, int64_t bs, const float* x,
              int64_t K, int64_t r0, float* y, int64_t R, int64_t o0) {
  __m512 acc[W][M];
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) acc[i][t] = _mm512_setzero_ps();
  const int64_t scales_per_row = K / bs, blocks_per_row = K / QB, ahead = prefetch_rows(W, row_bytes);
  for (int64_t c = 0; c < K / 32; ++c) {
    for (int i = 0; i < W; ++i) {
      const int64_t o = o0 + i;
      __m512 w0, w1;
      if constexpr (U4) {
        const uint8_t* p = w + o * row_bytes + c * 16;
        if (o + ahead < R) prefetch_next(p + ahead * row_bytes);
        const __m512 s = _mm512_set1_ps(to_float(ws[o * scales_per_row + c]));
        const __m512 m = _mm512_set1_ps(to_float(wo[o * blocks_per_row + c]));
        w0 = _mm512_fmadd_ps(codes16<true>(p, false), s, m);
        w1 = _mm512_fmadd_ps(codes16<true>(p, true), s, m);
      } else {
        const uint8_t* p = w + o * row_bytes + c * 32;
        if (o + ahead < R) prefetch_next(p + ahead * row_bytes);
        const S* sp = ws + o * scales_per_row + c * (32 / bs);
        const float s0 = to_float(sp[0]), s1 = bs == 16 ? to_float(sp[1]) : s0;
        w0 = _mm512_mul_ps(codes16<false>(p, false), _mm512_set1_ps(s0));
        w1 = _mm512_mul_ps(codes16<false>(p + 16, false), _mm512_set1_ps(s1));
      }
      for (int t = 0; t < M; ++t) {
        const float* xr = x + (r0 + t) * K + c * 32;
        acc[i][t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[i][t]);
        acc[i][t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) y[(r0 + t) * R + o0 + i] = _mm512_reduce_add_ps(acc[i][t]);
}

#elif defined(__AVX2__)

// 16 vector registers: 4 weight rows x 2 activation rows, or one weight row (4 vectors) x 8 rows
constexpr int NARROW_W = 4, NARROW_M = 2, WIDE_W = 1, WIDE_M = 8;

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 codes from p as floats (u4: the low or high nibbles of 8 bytes; s8: 8 signed bytes)
template <bool U4>
inline __m256 codes8(const uint8_t* p, bool hi) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (U4) {
    const __m128i q = hi ? _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)) : _mm_and_si128(b, _mm_set1_epi8(0x0F));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}

// As the AVX-512 tile_dot: a chunk is one block of 32 elements, four vectors of 8.
template <bool U4, typename S, int W, int M>
void tile_dot(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wo, int64_t bs, const float* x,
              int64_t K, int64_t r0, float* y, int64_t R, int64_t o0) {
  __m256 acc[W][M];
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) acc[i][t] = _mm256_setzero_ps();
  const int64_t scales_per_row = K / bs, blocks_per_row = K / QB, ahead = prefetch_rows(W, row_bytes);
  for (int64_t c = 0; c < K / 32; ++c) {
    for (int i = 0; i < W; ++i) {
      const int64_t o = o0 + i;
      __m256 wv[4];
      if constexpr (U4) {
        const uint8_t* p = w + o * row_bytes + c * 16;
        if (o + ahead < R) prefetch_next(p + ahead * row_bytes);
        const __m256 s = _mm256_set1_ps(to_float(ws[o * scales_per_row + c]));
        const __m256 m = _mm256_set1_ps(to_float(wo[o * blocks_per_row + c]));
        wv[0] = _mm256_fmadd_ps(codes8<true>(p, false), s, m);
        wv[1] = _mm256_fmadd_ps(codes8<true>(p + 8, false), s, m);
        wv[2] = _mm256_fmadd_ps(codes8<true>(p, true), s, m);
        wv[3] = _mm256_fmadd_ps(codes8<true>(p + 8, true), s, m);
      } else {
        const uint8_t* p = w + o * row_bytes + c * 32;
        if (o + ahead < R) prefetch_next(p + ahead * row_bytes);
        const S* sp = ws + o * scales_per_row + c * (32 / bs);
        const __m256 s0 = _mm256_set1_ps(to_float(sp[0]));
        const __m256 s1 = bs == 16 ? _mm256_set1_ps(to_float(sp[1])) : s0;
        wv[0] = _mm256_mul_ps(codes8<false>(p, false), s0);
        wv[1] = _mm256_mul_ps(codes8<false>(p + 8, false), s0);
        wv[2] = _mm256_mul_ps(codes8<false>(p + 16, false), s1);
        wv[3] = _mm256_mul_ps(codes8<false>(p + 24, false), s1);
      }
      for (int t = 0; t < M; ++t) {
        const float* xr = x + (r0 + t) * K + c * 32;
        for (int j = 0; j < 4; ++j) acc[i][t] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xr + 8 * j), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) y[(r0 + t) * R + o0 + i] = hsum8(acc[i][t]);
}

#else

constexpr int NARROW_W = 1, NARROW_M = 1, WIDE_W = 1, WIDE_M = 1;

// Portable fallback: one weight row and one activation row, the weights dequantized element by element.
template <bool U4, typename S, int W, int M>
void tile_dot(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wo, int64_t bs, const float* x,
              int64_t K, int64_t r0, float* y, int64_t R, int64_t o0) {
  const uint8_t* wr = w + o0 * row_bytes;
  const float* xr = x + r0 * K;
  float acc = 0.f;
  for (int64_t e = 0; e < K; ++e) {
    float v;
    if constexpr (U4) {
      const int64_t blk = e / 32, j = e % 32;
      const uint8_t byte = wr[blk * 16 + (j % 16)];
      const float q = static_cast<float>(j < 16 ? (byte & 0x0F) : (byte >> 4));
      v = std::fma(q, to_float(ws[o0 * (K / bs) + blk]), to_float(wo[o0 * (K / QB) + blk]));
    } else {
      v = static_cast<float>(static_cast<int8_t>(wr[e])) * to_float(ws[o0 * (K / bs) + e / bs]);
    }
    acc = std::fma(v, xr[e], acc);
  }
  y[r0 * R + o0] = acc;
}

#endif

// f(m) with the activation-row count m = min(nt, M) as a compile-time constant (std::integral_constant),
// so a tile's accumulators stay in registers
template <int M, typename F>
inline void with_rows(int64_t nt, F&& f) {
  if constexpr (M >= 8) if (nt >= 8) return f(std::integral_constant<int, 8>{});
  if constexpr (M >= 7) if (nt == 7) return f(std::integral_constant<int, 7>{});
  if constexpr (M >= 6) if (nt == 6) return f(std::integral_constant<int, 6>{});
  if constexpr (M >= 5) if (nt == 5) return f(std::integral_constant<int, 5>{});
  if constexpr (M >= 4) if (nt == 4) return f(std::integral_constant<int, 4>{});
  if constexpr (M >= 3) if (nt == 3) return f(std::integral_constant<int, 3>{});
  if constexpr (M >= 2) if (nt == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

// Runs tile(w, m, r0, o0) over an [n, K] x [R, K]^T product: weight rows in tiles of W (the last ones one
// at a time), activation rows in groups of up to M; w and m are integral constants. Threads split the
// weight tiles, each task getting enough work to pay for waking a thread.
template <int W, int M, typename Tile>
void schedule(int64_t n, int64_t K, int64_t R, Tile&& tile) {
  const int64_t tiles = (R + W - 1) / W;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K * n * W));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * W;
      for (int64_t r0 = 0; r0 < n; r0 += M) {
        const int64_t nt = std::min<int64_t>(M, n - r0);
        if (o0 + W <= R) {
          with_rows<M>(nt, [&](auto m) { tile(std::integral_constant<int, W>{}, m, r0, o0); });
        } else {
          for (int64_t o = o0; o < R; ++o)
            with_rows<M>(nt, [&](auto m) { tile(std::integral_constant<int, 1>{}, m, r0, o); });
        }
      }
    }
  });
}

template <bool U4, typename S, int W, int M>
void run_tiles(const float* X, int64_t n, int64_t K, const uint8_t* wq, const S* ws, const S* woff,
               int64_t bs, int64_t R, float* y) {
  const int64_t row_bytes = U4 ? K / 2 : K;
  schedule<W, M>(n, K, R, [&](auto w, auto m, int64_t r0, int64_t o0) {
    tile_dot<U4, S, decltype(w)::value, decltype(m)::value>(wq, row_bytes, ws, woff, bs, X, K, r0, y, R, o0);
  });
}

template <bool U4, typename S>
void run_rows(const float* X, int64_t n, int64_t K, const uint8_t* wq, const S* ws, const S* woff,
              int64_t bs, int64_t R, float* y) {
  if (n <= NARROW_M) run_tiles<U4, S, NARROW_W, NARROW_M>(X, n, K, wq, ws, woff, bs, R, y);
  else run_tiles<U4, S, WIDE_W, WIDE_M>(X, n, K, wq, ws, woff, bs, R, y);
}


// ---- 8-bit activations ------------------------------------------------------------------------------
// qlinear8 rounds each activation row to 8 bits per block of 32 (x ~ d * q, q in -127..127, as llama.cpp's
// Q8_0) and multiplies the codes in integers: one instruction takes 32 weight codes against 32 activation
// codes. The error against the float product is at most d/2 * sum|w| per block (tested); each row is
// rounded and summed alone, so a row's result still does not depend on the other rows of the call.

// per row r and block b of 32: codes q [n, K] int8, scale d [n, K/32] (max|x| / 127) and the block's sum of
// x [n, K/32] (what a u4 block's offset multiplies)
//
// Opt-in (SPECULUM_ACT8=1, speculum/runners/decoder.py): with the weights prefetched, a one-row product waits
// on memory either way, and over several rows the integer path spends more instructions per row than
// the float one (a conversion and a scale per block and row).
void quantize_rows(const float* X, int64_t n, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / 32;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = X + r * K + b * 32;
      float amax = 0.0f, sum = 0.0f;
      for (int i = 0; i < 32; ++i) {
        amax = std::max(amax, std::fabs(x[i]));
        sum += x[i];
      }
      const float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qr = q + r * K + b * 32;
      for (int i = 0; i < 32; ++i)
        qr[i] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(x[i] * id))));
      d[r * nb + b] = dd;
      s[r * nb + b] = sum;
    }
}

#if defined(__AVX2__) && defined(__FMA__)

#if defined(__AVX512F__)
constexpr int Q8_NARROW_W = 4, Q8_NARROW_M = 2, Q8_WIDE_W = 2, Q8_WIDE_M = 8;
#else
constexpr int Q8_NARROW_W = 4, Q8_NARROW_M = 2, Q8_WIDE_W = 1, Q8_WIDE_M = 8;
#endif

inline float hsum8_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 int32 lanes, lane l = sum of the products of bytes 4l .. 4l+3 (u unsigned, s signed; exact here:
// |u| <= 127 and |s| <= 127 keep maddubs' 16-bit pairs from saturating)
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

template <bool U4, typename S, int W, int M>
void tile_dot8(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wo, int64_t bs, const int8_t* xq,
               const float* xd, const float* xs, int64_t K, int64_t r0, float* y, int64_t R, int64_t o0) {
  __m256 acc[W][M];
  float off[W][M];
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) {
      acc[i][t] = _mm256_setzero_ps();
      off[i][t] = 0.0f;
    }
  const int64_t scales_per_row = K / bs, nb = K / 32, ahead = prefetch_rows(W, row_bytes);
  for (int64_t c = 0; c < nb; ++c) {
    for (int i = 0; i < W; ++i) {
      const int64_t o = o0 + i;
      __m256i cw, raw;
      __m256 sv;
      float mo = 0.0f;
      if constexpr (U4) {
        if (o + ahead < R) prefetch_next(w + (o + ahead) * row_bytes + c * 16);
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + o * row_bytes + c * 16));
        const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
        cw = _mm256_set_m128i(hi, lo);
        raw = cw;
        sv = _mm256_set1_ps(to_float(ws[o * scales_per_row + c]));
        mo = to_float(wo[o * nb + c]);
      } else {
        if (o + ahead < R) prefetch_next(w + (o + ahead) * row_bytes + c * 32);
        raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * row_bytes + c * 32));
        cw = _mm256_abs_epi8(raw);
        const S* sp = ws + o * scales_per_row + c * (32 / bs);
        const float s0 = to_float(sp[0]);
        sv = bs == 16 ? _mm256_set_m128(_mm_set1_ps(to_float(sp[1])), _mm_set1_ps(s0)) : _mm256_set1_ps(s0);
      }
      for (int t = 0; t < M; ++t) {
        const int64_t r = r0 + t;
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + c * 32));
        if constexpr (!U4) xv = _mm256_sign_epi8(xv, raw);
        const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(cw, xv));
        acc[i][t] = _mm256_fmadd_ps(p, _mm256_mul_ps(sv, _mm256_set1_ps(xd[r * nb + c])), acc[i][t]);
        if constexpr (U4) off[i][t] = std::fma(mo, xs[r * nb + c], off[i][t]);
      }
    }
  }
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) y[(r0 + t) * R + o0 + i] = hsum8_ps(acc[i][t]) + off[i][t];
}

#else  // portable

constexpr int Q8_NARROW_W = 1, Q8_NARROW_M = 1, Q8_WIDE_W = 1, Q8_WIDE_M = 1;

template <bool U4, typename S, int W, int M>
void tile_dot8(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wo, int64_t bs, const int8_t* xq,
               const float* xd, const float* xs, int64_t K, int64_t r0, float* y, int64_t R, int64_t o0) {
  const int64_t scales_per_row = K / bs, nb = K / 32;
  for (int t = 0; t < M; ++t) {
    const int64_t r = r0 + t;
    float acc = 0.0f, off = 0.0f;
    for (int64_t c = 0; c < nb; ++c) {
      for (int64_t half = 0; half < 32 / bs; ++half) {  // one scale per bs elements
        int32_t dot = 0;
        for (int64_t e = half * bs; e < (half + 1) * bs; ++e) {
          int32_t q;
          if constexpr (U4) {
            const uint8_t byte = w[o0 * row_bytes + c * 16 + (e % 16)];
            q = e < 16 ? (byte & 0x0F) : (byte >> 4);
          } else {
            q = static_cast<int8_t>(w[o0 * row_bytes + c * 32 + e]);
          }
          dot += q * xq[r * K + c * 32 + e];
        }
        acc = std::fma(static_cast<float>(dot), to_float(ws[o0 * scales_per_row + c * (32 / bs) + half]) * xd[r * nb + c], acc);
      }
      if constexpr (U4) off = std::fma(to_float(wo[o0 * nb + c]), xs[r * nb + c], off);
    }
    y[r * R + o0] = acc + off;
  }
}

#endif

template <bool U4, typename S, int W, int M>
void run_tiles8(const int8_t* xq, const float* xd, const float* xs, int64_t n, int64_t K, const uint8_t* wq,
                const S* ws, const S* woff, int64_t bs, int64_t R, float* y) {
  const int64_t row_bytes = U4 ? K / 2 : K;
  schedule<W, M>(n, K, R, [&](auto w, auto m, int64_t r0, int64_t o0) {
    tile_dot8<U4, S, decltype(w)::value, decltype(m)::value>(wq, row_bytes, ws, woff, bs, xq, xd, xs, K, r0, y, R, o0);
  });
}

template <bool U4, typename S>
void run_rows8(const int8_t* xq, const float* xd, const float* xs, int64_t n, int64_t K, const uint8_t* wq,
               const S* ws, const S* woff, int64_t bs, int64_t R, float* y) {
  if (n <= Q8_NARROW_M) run_tiles8<U4, S, Q8_NARROW_W, Q8_NARROW_M>(xq, xd, xs, n, K, wq, ws, woff, bs, R, y);
  else run_tiles8<U4, S, Q8_WIDE_W, Q8_WIDE_M>(xq, xd, xs, n, K, wq, ws, woff, bs, R, y);
}


// Checks a product's operands (x made float32 and contiguous), then calls run(u4, scales, offsets, y) with
// u4 a std::bool_constant and the scales' and offsets' element type (uint16_t for float16, or float).
template <typename Run>
torch::Tensor product(torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& scales,
                      const torch::Tensor& offsets, int64_t bs, bool u4, Run&& run) {
  TORCH_CHECK(x.dim() == 2, "x must be [n, K]");
  TORCH_CHECK(bs == 32 || (bs == 16 && !u4), "block size 32 (or 16 for s8 codes)");
  x = x.to(torch::kFloat32).contiguous();
  const int64_t n = x.size(0), K = x.size(1), R = scales.size(0);
  TORCH_CHECK(K % QB == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(wq.is_contiguous() && scales.is_contiguous(), "codes and scales must be contiguous");
  TORCH_CHECK(wq.size(0) == R && wq.size(1) == (u4 ? K / 2 : K) && scales.size(1) == K / bs, "shapes disagree");
  auto y = torch::empty({n, R}, x.options());
  if (n == 0 || R == 0) return y;
  float* Y = y.data_ptr<float>();
  auto typed = [&](const auto* s, const auto* o) {
    if (u4) run(std::true_type{}, s, o, Y);
    else run(std::false_type{}, s, o, Y);
  };
  if (scales.scalar_type() == torch::kFloat16) {
    const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr());
    typed(s, u4 ? reinterpret_cast<const uint16_t*>(offsets.data_ptr()) : s);
  } else {
    TORCH_CHECK(scales.scalar_type() == torch::kFloat32, "scales must be float16 or float32");
    const float* s = scales.data_ptr<float>();
    typed(s, u4 ? offsets.data_ptr<float>() : s);
  }
  return y;
}

template <typename P>
using elem_t = std::remove_cv_t<std::remove_pointer_t<P>>;

}  // namespace

// y [n, R] float32 = x [n, K] @ W^T for W given as codes `wq` ([R, K/2] uint8 for u4, [R, K] int8 for s8),
// `scales` [R, K/bs] (float16 or float32) and, for u4, `offsets` [R, K/32] of the scales' dtype.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor wq, torch::Tensor scales, torch::Tensor offsets, int64_t bs,
                      bool u4) {
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  return product(x, wq, scales, offsets, bs, u4, [&](auto u4c, const auto* s, const auto* o, float* y) {
    run_rows<decltype(u4c)::value, elem_t<decltype(s)>>(x.data_ptr<float>(), x.size(0), x.size(1), w, s, o, bs,
                                                        scales.size(0), y);
  });
}

// qlinear with the activations rounded to 8 bits per block of 32 (see quantize_rows): same arguments.
torch::Tensor qlinear8(torch::Tensor x, torch::Tensor wq, torch::Tensor scales, torch::Tensor offsets, int64_t bs,
                       bool u4) {
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  return product(x, wq, scales, offsets, bs, u4, [&](auto u4c, const auto* s, const auto* o, float* y) {
    const int64_t n = x.size(0), K = x.size(1);
    auto xq = torch::empty({n, K}, x.options().dtype(torch::kInt8));
    auto xd = torch::empty({n, K / 32}, x.options());
    auto xs = torch::empty({n, K / 32}, x.options());
    quantize_rows(x.data_ptr<float>(), n, K, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>());
    run_rows8<decltype(u4c)::value, elem_t<decltype(s)>>(xq.data_ptr<int8_t>(), xd.data_ptr<float>(),
                                                         xs.data_ptr<float>(), n, K, w, s, o, bs, scales.size(0), y);
  });
}

// Rows `ids` [m] of the weight, dequantized: [m, K] float32 (an embedding lookup on quantized codes).
torch::Tensor dequant_rows(torch::Tensor ids, torch::Tensor wq, torch::Tensor scales, torch::Tensor offsets,
                           int64_t bs, bool u4) {
  ids = ids.to(torch::kInt64).contiguous();
  const int64_t m = ids.size(0), R = scales.size(0), K = scales.size(1) * bs;
  auto out = torch::empty({m, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const int64_t* id = ids.data_ptr<int64_t>();
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const bool half = scales.scalar_type() == torch::kFloat16;
  auto scale = [&](const torch::Tensor& t, int64_t i) {
    return half ? c10::detail::fp16_ieee_to_fp32_value(reinterpret_cast<const uint16_t*>(t.data_ptr())[i])
                : t.data_ptr<float>()[i];
  };
  float* y = out.data_ptr<float>();
  for (int64_t j = 0; j < m; ++j) {
    const int64_t o = id[j];
    TORCH_CHECK(o >= 0 && o < R, "row index out of range");
    for (int64_t e = 0; e < K; ++e) {
      float v;
      if (u4) {
        const int64_t blk = e / 32, k = e % 32;
        const uint8_t byte = w[o * (K / 2) + blk * 16 + (k % 16)];
        const int q = k < 16 ? (byte & 0x0F) : (byte >> 4);
        v = scale(scales, o * (K / bs) + e / bs) * static_cast<float>(q) + scale(offsets, o * (K / 32) + blk);
      } else {
        v = scale(scales, o * (K / bs) + e / bs) * static_cast<float>(static_cast<int8_t>(w[o * K + e]));
      }
      y[j * K + e] = v;
    }
  }
  return out;
}

// The whole weight dequantized: [R, K] float32 (w = scale * q + offset per block, rounded as the products'
// fused multiply-add rounds it), rows split over threads; a long prompt chunk's products then run as one
// float GEMM.
torch::Tensor dequantize(torch::Tensor wq, torch::Tensor scales, torch::Tensor offsets, int64_t bs, bool u4) {
  TORCH_CHECK(wq.is_contiguous() && scales.is_contiguous(), "codes and scales must be contiguous");
  const int64_t R = scales.size(0), K = scales.size(1) * bs, nb = K / 32;
  auto out = torch::empty({R, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  float* y = out.data_ptr<float>();
  auto body = [&](auto sp, auto op) {
    at::parallel_for(0, R, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, K)), [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o)
        for (int64_t c = 0; c < nb; ++c) {
          float* row = y + o * K + c * 32;
          if (u4) {
            const uint8_t* b = w + o * (K / 2) + c * 16;
            const float sc = to_float(sp[o * nb + c]), m = to_float(op[o * nb + c]);
            for (int i = 0; i < 16; ++i) {
              row[i] = std::fma(static_cast<float>(b[i] & 0x0F), sc, m);
              row[i + 16] = std::fma(static_cast<float>(b[i] >> 4), sc, m);
            }
          } else {
            const int8_t* b = reinterpret_cast<const int8_t*>(w) + o * K + c * 32;
            for (int i = 0; i < 32; ++i)
              row[i] = static_cast<float>(b[i]) * to_float(sp[o * (K / bs) + (c * 32 + i) / bs]);
          }
        }
    });
  };
  if (scales.scalar_type() == torch::kFloat16) {
    const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
    body(sp, u4 ? reinterpret_cast<const uint16_t*>(offsets.data_ptr()) : sp);
  } else {
    TORCH_CHECK(scales.scalar_type() == torch::kFloat32, "scales must be float16 or float32");
    const float* sp = scales.data_ptr<float>();
    body(sp, u4 ? offsets.data_ptr<float>() : sp);
  }
  return out;
}

// The instruction set this build's kernels use.
std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

void register_layer_ops(pybind11::module& m);  // layer_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_layer_ops(m);
  m.def("qlinear", &qlinear, "x @ W^T on block-quantized W");
  m.def("qlinear8", &qlinear8, "x @ W^T on block-quantized W, x rounded to 8 bits per block of 32");
  m.def("dequant_rows", &dequant_rows, "rows of a block-quantized W, dequantized");
  m.def("dequantize", &dequantize, "a block-quantized W, dequantized");
  m.def("isa", &isa, "instruction set of this build");
}
