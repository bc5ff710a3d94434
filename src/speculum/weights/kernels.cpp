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
// Activations are quantized as llama.cpp does: per block of 32, d = max|x| / 127, q = round(x / d).
// A block's product is then an exact integer dot product scaled by d_w * d_x, and the blocks' terms are
// summed in float32. Each row of the output is computed by the same instructions in the same order
// whatever the number of rows in the call, so a row's result does not depend on the others.
//
// Lanes: every integer dot product below (AVX-512 VNNI vpdpbusd, or vpmaddubsw + vpmaddwd) leaves the
// sum of 4 consecutive products in each 32-bit lane, so a lane's scale is its block's; the scales are
// broadcast per lane and the lanes are reduced once, at the end of the row.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QB = 32;    // activation block

struct QuantRows {
  std::vector<int8_t> q;     // [n, K] codes
  std::vector<float> lane;   // [n, K / 4] each lane's block scale d_x
  std::vector<float> bsum;   // [n, K / 4] d_x * sum(q) of each lane's block, over 8 (the lanes per block):
                             // the offsets' term of u4 weights, summed with the lanes
};

void quantize_rows(const float* x, int64_t n, int64_t K, QuantRows& out) {
  out.q.resize(n * K);
  out.lane.resize(n * K / 4);
  out.bsum.resize(n * K / 4);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t b = 0; b < K / QB; ++b) {
      const float* xb = x + r * K + b * QB;
      float amax = 0.f;
      for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      int8_t* qb = out.q.data() + r * K + b * QB;
      int sum = 0;
      for (int i = 0; i < QB; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * id));
        qb[i] = static_cast<int8_t>(v);
        sum += v;
      }
      const float share = d * static_cast<float>(sum) / 8.f;  // exact: a power of two
      for (int j = 0; j < QB / 4; ++j) {
        out.lane[r * (K / 4) + b * (QB / 4) + j] = d;
        out.bsum[r * (K / 4) + b * (QB / 4) + j] = share;
      }
    }
  }
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// `count` (1, 2 or 4) scales from p as the first lanes of a float vector (the rest zero)
inline __m128 load_scales(const float* p, int count) {
  if (count == 4) return _mm_loadu_ps(p);
  if (count == 2) return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
  return _mm_load_ss(p);
}
inline __m128 load_scales(const uint16_t* p, int count) {
  if (count == 4) return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if (count == 2) {
    int32_t two;
    std::memcpy(&two, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(two));
  }
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(p[0])));
}

// A tile is WR weight rows (o0 ..) against up to NT activation rows (r0 .., nt of them): WR * nt independent
// accumulators, one per output, each summed over the chunks in order, then reduced once.
#if defined(__AVX512F__) && defined(__AVX512BW__)

constexpr int WR = 4;
#define NT 4

inline __m512i dot4(__m512i w_u8, __m512i x_s8) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w_u8, x_s8);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(w_u8, x_s8), _mm512_set1_epi16(1));
#endif
}

// A chunk is 64 elements (16 lanes); a trailing 32 runs with the upper half zero.
template <bool U4, typename S, int W, int M>
void tile_dot(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wo, int64_t bs, const QuantRows& X,
              int64_t K, int64_t r0, float* y, int64_t R, int64_t o0) {
  __m512 acc[W][M];
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) acc[i][t] = _mm512_setzero_ps();
  const int per_chunk = static_cast<int>(64 / bs);  // weight scales per chunk: 2 or 4
  const __m512i idx = bs == 32 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                               : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t scales_per_row = K / bs, blocks_per_row = K / QB;
  for (int64_t c = 0; c * 64 < K; ++c) {
    const bool half_chunk = c * 64 + 64 > K;  // only 32 elements left
    const __mmask64 bytes = half_chunk ? 0xFFFFFFFFull : ~0ull;
    const __mmask16 lanes = half_chunk ? 0x00FF : 0xFFFF;
    const int nscale = half_chunk ? per_chunk / 2 : per_chunk;
    for (int i = 0; i < W; ++i) {
      const uint8_t* wr = w + (o0 + i) * row_bytes;
      __m512i wv;
      __mmask64 neg = 0;
      __m512 ol = _mm512_setzero_ps();
      if constexpr (U4) {
        __m256i raw = half_chunk ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(wr + c * 32)))
                                 : _mm256_loadu_si256((const __m256i*)(wr + c * 32));
        __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(raw), raw, 1);  // [b0, b1, b0, b1]
        z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));              // [b0, b0, b1, b1]
        wv = _mm512_mask_blend_epi64(0xCC, _mm512_and_si512(z, nib), _mm512_and_si512(_mm512_srli_epi16(z, 4), nib));
        if (half_chunk) wv = _mm512_maskz_mov_epi8(bytes, wv);
        ol = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(
                                            load_scales(wo + (o0 + i) * blocks_per_row + c * 2, nscale)));
      } else {
        const __m512i raw = _mm512_maskz_loadu_epi8(bytes, wr + c * 64);
        wv = _mm512_abs_epi8(raw);
        neg = _mm512_movepi8_mask(raw);
      }
      const __m512 wl = _mm512_permutexvar_ps(
          idx, _mm512_castps128_ps512(load_scales(ws + (o0 + i) * scales_per_row + c * per_chunk, nscale)));
      for (int t = 0; t < M; ++t) {
        const int64_t r = r0 + t;
        __m512i xq = _mm512_maskz_loadu_epi8(bytes, X.q.data() + r * K + c * 64);
        if constexpr (!U4) xq = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
        const __m512i p = dot4(wv, xq);
        const __m512 sc = _mm512_mul_ps(wl, _mm512_maskz_loadu_ps(lanes, X.lane.data() + r * (K / 4) + c * 16));
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[i][t]);
        if constexpr (U4)
          acc[i][t] = _mm512_fmadd_ps(ol, _mm512_maskz_loadu_ps(lanes, X.bsum.data() + r * (K / 4) + c * 16),
                                      acc[i][t]);
      }
    }
  }
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) y[(r0 + t) * R + o0 + i] = _mm512_reduce_add_ps(acc[i][t]);
}

#elif defined(__AVX2__)

constexpr int WR = 4;  // 16 vector registers: 8 accumulators
#define NT 2

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// As the AVX-512 tile_dot, with chunks of 32 elements (8 lanes).
template <bool U4, typename S, int W, int M>
void tile_dot(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wo, int64_t bs, const QuantRows& X,
              int64_t K, int64_t r0, float* y, int64_t R, int64_t o0) {
  __m256 acc[W][M];
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) acc[i][t] = _mm256_setzero_ps();
  const int per_chunk = static_cast<int>(32 / bs);  // 1 or 2
  const __m256i idx = bs == 32 ? _mm256_setzero_si256() : _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t scales_per_row = K / bs, blocks_per_row = K / QB;
  for (int64_t c = 0; c * 32 < K; ++c) {
    for (int i = 0; i < W; ++i) {
      const uint8_t* wr = w + (o0 + i) * row_bytes;
      __m256i wv, raw;
      __m256 ol = _mm256_setzero_ps();
      if constexpr (U4) {
        const __m128i b = _mm_loadu_si128((const __m128i*)(wr + c * 16));
        raw = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
        wv = _mm256_and_si256(raw, nib);
        ol = _mm256_broadcastss_ps(load_scales(wo + (o0 + i) * blocks_per_row + c, 1));
      } else {
        raw = _mm256_loadu_si256((const __m256i*)(wr + c * 32));
        wv = _mm256_sign_epi8(raw, raw);  // |w|
      }
      const __m256 wl = _mm256_permutevar8x32_ps(
          _mm256_castps128_ps256(load_scales(ws + (o0 + i) * scales_per_row + c * per_chunk, per_chunk)), idx);
      for (int t = 0; t < M; ++t) {
        const int64_t r = r0 + t;
        __m256i xq = _mm256_loadu_si256((const __m256i*)(X.q.data() + r * K + c * 32));
        if constexpr (!U4) xq = _mm256_sign_epi8(xq, raw);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xq), ones);
        const __m256 sc = _mm256_mul_ps(wl, _mm256_loadu_ps(X.lane.data() + r * (K / 4) + c * 8));
        acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[i][t]);
        if constexpr (U4)
          acc[i][t] = _mm256_fmadd_ps(ol, _mm256_loadu_ps(X.bsum.data() + r * (K / 4) + c * 8), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < W; ++i)
    for (int t = 0; t < M; ++t) y[(r0 + t) * R + o0 + i] = hsum8(acc[i][t]);
}

#else

constexpr int WR = 1;
#define NT 1

// Portable fallback: per block, an integer dot product scaled by d_w * d_x, plus the offset's term.
template <bool U4, typename S, int W, int M>
void tile_dot(const uint8_t* w, int64_t row_bytes, const S* ws, const S* wo, int64_t bs, const QuantRows& X,
              int64_t K, int64_t r0, float* y, int64_t R, int64_t o0) {
  const uint8_t* wr = w + o0 * row_bytes;
  const S* sr = ws + o0 * (K / bs);
  const S* orow = U4 ? wo + o0 * (K / QB) : nullptr;
  const int64_t r = r0;
  const int8_t* xq = X.q.data() + r * K;
  float acc = 0.f;
  for (int64_t b = 0; b < K / bs; ++b) {
    int32_t dot = 0;
    for (int64_t i = 0; i < bs; ++i) {
      const int64_t e = b * bs + i;
      int32_t q;
      if constexpr (U4) {
        const int64_t blk = e / 32, j = e % 32;
        const uint8_t byte = wr[blk * 16 + (j % 16)];
        q = j < 16 ? (byte & 0x0F) : (byte >> 4);
      } else {
        q = static_cast<int8_t>(wr[e]);
      }
      dot += q * xq[e];
    }
    acc += static_cast<float>(dot) * (to_float(sr[b]) * X.lane[r * (K / 4) + (b * bs) / 4]);
    if constexpr (U4) acc += to_float(orow[b]) * (8.f * X.bsum[r * (K / 4) + b * 8]);
  }
  y[r * R + o0] = acc;
}

#endif

// tile_dot with the activation-row count as a constant (so the accumulators stay in registers)
template <bool U4, typename S, int W, typename... A>
inline void tile_rows(int64_t nt, A... args) {
  switch (nt) {
    case 1: tile_dot<U4, S, W, 1>(args...); break;
#if NT > 1
    case 2: tile_dot<U4, S, W, 2>(args...); break;
#endif
#if NT > 2
    case 3: tile_dot<U4, S, W, 3>(args...); break;
    default: tile_dot<U4, S, W, 4>(args...); break;
#endif
  }
}

template <bool U4, typename S>
void run_rows(const QuantRows& X, int64_t n, int64_t K, const uint8_t* wq, const S* ws, const S* woff,
              int64_t bs, int64_t R, float* y) {
  const int64_t row_bytes = U4 ? K / 2 : K;
  // threads split the weight rows, in whole tiles; each task gets enough work to pay for waking a thread
  const int64_t tiles = (R + WR - 1) / WR;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K * n * WR));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t o0 = tile * WR;
      for (int64_t r0 = 0; r0 < n; r0 += NT) {
        const int64_t nt = std::min<int64_t>(NT, n - r0);
        if (o0 + WR <= R) {
          tile_rows<U4, S, WR>(nt, wq, row_bytes, ws, woff, bs, X, K, r0, y, R, o0);
        } else {
          for (int64_t o = o0; o < R; ++o) tile_rows<U4, S, 1>(nt, wq, row_bytes, ws, woff, bs, X, K, r0, y, R, o);
        }
      }
    }
  });
}

}  // namespace

// y [n, R] float32 = x [n, K] @ W^T for W given as codes `wq` ([R, K/2] uint8 for u4, [R, K] int8 for s8),
// `scales` [R, K/bs] (float16 or float32) and, for u4, `offsets` [R, K/32] of the scales' dtype.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor wq, torch::Tensor scales, torch::Tensor offsets, int64_t bs,
                      bool u4) {
  TORCH_CHECK(x.dim() == 2, "x must be [n, K]");
  TORCH_CHECK(bs == 32 || (bs == 16 && !u4), "block size 32 (or 16 for s8 codes)");
  x = x.to(torch::kFloat32).contiguous();
  const int64_t n = x.size(0), K = x.size(1), R = scales.size(0);
  TORCH_CHECK(K % QB == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(wq.is_contiguous() && scales.is_contiguous(), "codes and scales must be contiguous");
  TORCH_CHECK(wq.size(0) == R && wq.size(1) == (u4 ? K / 2 : K) && scales.size(1) == K / bs, "shapes disagree");
  auto y = torch::empty({n, R}, x.options());
  if (n == 0 || R == 0) return y;
  QuantRows X;
  quantize_rows(x.data_ptr<float>(), n, K, X);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  if (scales.scalar_type() == torch::kFloat16) {
    const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr());
    const auto* o = u4 ? reinterpret_cast<const uint16_t*>(offsets.data_ptr()) : nullptr;
    if (u4) run_rows<true, uint16_t>(X, n, K, w, s, o, bs, R, y.data_ptr<float>());
    else run_rows<false, uint16_t>(X, n, K, w, s, o, bs, R, y.data_ptr<float>());
  } else {
    TORCH_CHECK(scales.scalar_type() == torch::kFloat32, "scales must be float16 or float32");
    const float* s = scales.data_ptr<float>();
    const float* o = u4 ? offsets.data_ptr<float>() : nullptr;
    if (u4) run_rows<true, float>(X, n, K, w, s, o, bs, R, y.data_ptr<float>());
    else run_rows<false, float>(X, n, K, w, s, o, bs, R, y.data_ptr<float>());
  }
  return y;
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

// The instruction set this build's kernels use.
std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "x @ W^T on block-quantized W");
  m.def("dequant_rows", &dequant_rows, "rows of a block-quantized W, dequantized");
  m.def("isa", &isa, "instruction set of this build");
}
