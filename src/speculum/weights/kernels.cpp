// Matrix products on block-quantized weights for 1 to a few dozen rows (decoding and verification).
//
// Why hand-written: torch's weight-only CPU kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm)
// run slower than a float32 F.linear on AVX2 machines, and none of them reads GGUF's formats.
//
// The weights are stored in groups of 16 output rows (speculum/weights/formats.py). Within a group and a
// block of 32 inputs, the codes are eight 64-byte vectors, one per quad of 4 inputs; vector j holds, for
// each of the 16 outputs o, its 4 codes of inputs 4j .. 4j+3 (bytes 4o .. 4o+3):
//   u4: codes 0..15, w = scale * q + offset per block of 32 (Q4_0, Q4_1, Q4_K); vectors j and j + 4
//       share 64 bytes (j in the low nibbles, j + 4 in the high ones): 256 bytes per group and block;
//   s8: signed codes, w = scale * q per block of `bs` = 32 or 16 (Q8_0, Q5_0, Q6_K): 512 bytes.
// Scales [G, K/bs, 16] and offsets [G, K/32, 16] list a group's 16 outputs together, float16 (`half`)
// where the source format's are, else float32.
//
// qlinear rounds each activation row to 8 bits per block of 32, as llama.cpp does (x ~ d * q, d =
// max|x| / 127), and multiplies codes in integers: one instruction multiplies 4 inputs into 16 outputs
// (AVX-512 VNNI's dpbusd; AVX2's maddubs, 8 outputs). Each output is one vector lane: per block, the
// integer sum becomes a float and is scaled into the lane's sum, so no horizontal reduction is needed, a
// group's weights are read once per tile of activation rows, and each group is one contiguous stream.
// The error against the float product is at most d/2 * sum|w| per block (tested). Every row is rounded
// and summed alone, by the same operations in the same order whatever the other rows of the call, so a
// row's result does not depend on them; and the three code paths (AVX-512, AVX2, portable) perform the
// same integer sums and the same float operations per lane, so they give the same bits.
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

constexpr int64_t QB = 32;     // inputs per block (activation scale, u4 offset)
constexpr int64_t GROUP = 16;  // outputs per group

inline float to_float(float v) { return v; }
inline float to_float(uint16_t h) {  // exact either way; the F16C instruction is one, the portable code dozens
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// A group's code at output lane o and input e of block chunk p (the layout above).
template <bool U4>
inline int32_t code_at(const uint8_t* p, int64_t o, int64_t e) {
  const int64_t j = e / 4, k = e % 4;
  if constexpr (U4) {
    const uint8_t byte = p[(j % 4) * 64 + o * 4 + k];
    return j < 4 ? (byte & 0x0F) : (byte >> 4);
  } else {
    return static_cast<int8_t>(p[j * 64 + o * 4 + k]);
  }
}

// The activation rows, rounded: codes q [n, K] (-127..127), scale d [n, K/32], the rounded block's sum
// s = d * sum(q) [n, K/32] (what a u4 offset multiplies) and the codes' sums per 16 inputs c [n, K/16].
// The offset takes the rounded sum, not the exact one: then a block's product is exactly the rounded
// activations times w = scale * q + offset, whose error sum(w * e) stays small, where the exact sum
// would leave an error sum((w - offset) * e) on codes shifted by the offset (as llama.cpp's Q8_1).
struct Rows8 {
  torch::Tensor q, d, s, c;
};

// One block of 32 activations: codes q, and returns the scale d; c gets the codes' sums of the two
// halves. The vector code does what the scalar code does (the largest magnitude is exact in any order;
// one multiply and a round-to-nearest-even per element), so every build rounds alike.
inline float quantize_block(const float* x, int8_t* q, int32_t* c) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512 lim = _mm512_set1_ps(127.0f), neg = _mm512_set1_ps(-127.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_max_ps(neg, _mm512_min_ps(lim, _mm512_mul_ps(a, id))));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_max_ps(neg, _mm512_min_ps(lim, _mm512_mul_ps(b, id))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  c[0] = _mm512_reduce_add_epi32(qa);
  c[1] = _mm512_reduce_add_epi32(qb);
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256 lim = _mm256_set1_ps(127.0f), neg = _mm256_set1_ps(-127.0f);
  alignas(32) int32_t qi[32];
  for (int i = 0; i < 4; ++i)
    _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * i),
                       _mm256_cvtps_epi32(_mm256_max_ps(neg, _mm256_min_ps(lim, _mm256_mul_ps(v[i], id)))));
  c[0] = c[1] = 0;
  for (int e = 0; e < 32; ++e) {
    q[e] = static_cast<int8_t>(qi[e]);
    c[e / 16] += qi[e];
  }
#else
  float amax = 0.0f;
  for (int e = 0; e < QB; ++e) amax = std::max(amax, std::fabs(x[e]));
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  c[0] = c[1] = 0;
  for (int e = 0; e < QB; ++e) {
    q[e] = static_cast<int8_t>(std::nearbyint(std::max(-127.0f, std::min(127.0f, x[e] * id))));
    c[e / 16] += q[e];
  }
#endif
  return amax / 127.0f;
}

Rows8 quantize_rows(const torch::Tensor& x) {
  const int64_t n = x.size(0), K = x.size(1), nb = K / QB;
  Rows8 r{torch::empty({n, K}, x.options().dtype(torch::kInt8)), torch::empty({n, nb}, x.options()),
          torch::empty({n, nb}, x.options()), torch::empty({n, K / 16}, x.options().dtype(torch::kInt32))};
  const float* X = x.data_ptr<float>();
  int8_t* q = r.q.data_ptr<int8_t>();
  float *d = r.d.data_ptr<float>(), *s = r.s.data_ptr<float>();
  int32_t* c = r.c.data_ptr<int32_t>();
  // block i: elements 32 i .. 32 i + 31 of the [n, K] array
  at::parallel_for(0, n * nb, 1 << 10, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      d[i] = quantize_block(X + i * QB, q + i * QB, c + 2 * i);
      s[i] = d[i] * static_cast<float>(c[2 * i] + c[2 * i + 1]);
    }
  });
  return r;
}

// What a tile reads: weights (codes, scales, offsets, their block), activation rows, output.
template <typename S>
struct Operands {
  const uint8_t* codes;
  const S* scales;
  const S* offsets;
  int64_t bs, K;
  const int8_t* xq;
  const float *xd, *xs;
  const int32_t* xc;  // code sums per 16 inputs
  float* y;
  int64_t ystride;
  static constexpr int64_t chunk(bool u4) { return u4 ? 256 : 512; }  // code bytes per group and block
  // the sum of row r's codes over scale block h of block b (what the s8 path's +128 offset adds)
  int32_t code_sum(int64_t r, int64_t b, int64_t h) const {
    const int32_t* c = xc + r * (K / 16) + (b * QB + h * bs) / 16;
    return bs == 32 ? c[0] + c[1] : c[0];
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

constexpr int TILE_M = 8;

inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Group g (16 outputs) against activation rows r0 .. r0 + M - 1. dpbusd multiplies unsigned by signed
// bytes: u4 codes are unsigned; s8 codes are made unsigned by adding 128 (flipping the top bit), and
// 128 times the row's code sum is taken back off the integer sum.
template <bool U4, typename S, int M>
void tile(const Operands<S>& a, int64_t g, int64_t r0) {
  const int64_t K = a.K, nb = K / QB, bs = a.bs, spb = QB / bs, qpb = bs / 4, chunk = a.chunk(U4);
  __m512 acc[M];
  for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
  const uint8_t* p = a.codes + g * nb * chunk;
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b, p += chunk) {
    __m512i v[8];
    if constexpr (U4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(p + 64 * j);
        v[j] = _mm512_and_si512(raw, low);
        v[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
    } else {
      for (int j = 0; j < 8; ++j) v[j] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * j), flip);
    }
    for (int64_t h = 0; h < spb; ++h) {
      const __m512 s = load16(a.scales + ((g * (K / bs)) + b * spb + h) * GROUP);
      for (int t = 0; t < M; ++t) {
        const int64_t r = r0 + t;
        const int8_t* xr = a.xq + r * K + b * QB + h * bs;
        __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
        for (int64_t j = 0; j < qpb; j += 2) {
          i0 = _mm512_dpbusd_epi32(i0, v[h * qpb + j], bcast4(xr + 4 * j));
          i1 = _mm512_dpbusd_epi32(i1, v[h * qpb + j + 1], bcast4(xr + 4 * j + 4));
        }
        __m512i isum = _mm512_add_epi32(i0, i1);
        if constexpr (!U4) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * a.code_sum(r, b, h)));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, _mm512_set1_ps(a.xd[r * nb + b])), acc[t]);
      }
    }
    if constexpr (U4) {
      const __m512 m = load16(a.offsets + (g * nb + b) * GROUP);
      for (int t = 0; t < M; ++t) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.xs[(r0 + t) * nb + b]), acc[t]);
    }
  }
  for (int t = 0; t < M; ++t) _mm512_storeu_ps(a.y + (r0 + t) * a.ystride + g * GROUP, acc[t]);
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int TILE_M = 4;

inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// As the AVX-512 tile, in two halves of 8 outputs, one after the other over the whole input (the
// group's codes stay in L1 for the second pass), so only one half's M accumulators share AVX2's 16
// registers with its 8 code vectors; the block size is a template argument, so the inner loops carry
// no run-time block arithmetic. maddubs multiplies unsigned by signed bytes into 16-bit pairs: u4 codes
// (<= 15) times activation codes (|q| <= 127) sum to at most 16 * 15 * 127 over a block, so the eight
// quads add in 16 bits; s8 codes multiply as |w| times the activation code carrying w's sign (a pair
// stays within 2 * 128 * 127), each quad widened to 32 bits.
template <bool U4, typename S, int M, int BS>
void tile_bs(const Operands<S>& a, int64_t g, int64_t r0) {
  constexpr int64_t SPB = QB / BS, QPB = BS / 4, CHUNK = Operands<S>::chunk(U4);
  const int64_t K = a.K, nb = K / QB;
  const uint8_t* codes = a.codes + g * nb * CHUNK;
  const S* scales = a.scales + g * (K / BS) * GROUP;
  const S* offsets = a.offsets + g * nb * GROUP;
  const int8_t* xq[M];
  const float *xd[M], *xs[M];
  for (int t = 0; t < M; ++t) {
    xq[t] = a.xq + (r0 + t) * K;
    xd[t] = a.xd + (r0 + t) * nb;
    xs[t] = a.xs + (r0 + t) * nb;
  }
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[M];
    for (int t = 0; t < M; ++t) acc[t] = _mm256_setzero_ps();
    const uint8_t* p = codes + 32 * half;
    for (int64_t b = 0; b < nb; ++b, p += CHUNK) {
      __m256i v[8];
      if constexpr (U4) {
        for (int j = 0; j < 4; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j));
          v[j] = _mm256_and_si256(raw, low);
          v[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
      } else {
        for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j));
      }
      for (int64_t h = 0; h < SPB; ++h) {
        const __m256 s = load8(scales + (b * SPB + h) * GROUP + 8 * half);
        for (int t = 0; t < M; ++t) {
          const int8_t* xr = xq[t] + b * QB + h * BS;
          __m256i isum;
          if constexpr (U4) {
            __m256i pairs = _mm256_maddubs_epi16(v[0], bcast4(xr));
            for (int j = 1; j < 8; ++j) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[j], bcast4(xr + 4 * j)));
            isum = _mm256_madd_epi16(pairs, ones);
          } else {
            isum = _mm256_setzero_si256();
            for (int64_t j = 0; j < QPB; ++j) {
              const __m256i w = v[h * QPB + j];
              const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(bcast4(xr + 4 * j), w));
              isum = _mm256_add_epi32(isum, _mm256_madd_epi16(prod, ones));
            }
          }
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(s, _mm256_set1_ps(xd[t][b])), acc[t]);
        }
      }
      if constexpr (U4) {
        const __m256 m = load8(offsets + b * GROUP + 8 * half);
        for (int t = 0; t < M; ++t) acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t][b]), acc[t]);
      }
    }
    for (int t = 0; t < M; ++t) _mm256_storeu_ps(a.y + (r0 + t) * a.ystride + g * GROUP + 8 * half, acc[t]);
  }
}

template <bool U4, typename S, int M>
void tile(const Operands<S>& a, int64_t g, int64_t r0) {
  if (U4 || a.bs == 32) tile_bs<U4, S, M, 32>(a, g, r0);
  else tile_bs<U4, S, M, 16>(a, g, r0);
}

#else

constexpr int TILE_M = 1;

// Portable: the same integer sums and float operations per output, one at a time.
template <bool U4, typename S, int M>
void tile(const Operands<S>& a, int64_t g, int64_t r0) {
  const int64_t K = a.K, nb = K / QB, bs = a.bs, spb = QB / bs, chunk = a.chunk(U4);
  for (int t = 0; t < M; ++t) {
    const int64_t r = r0 + t;
    for (int64_t o = 0; o < GROUP; ++o) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = a.codes + (g * nb + b) * chunk;
        for (int64_t h = 0; h < spb; ++h) {
          int32_t isum = 0;
          for (int64_t e = h * bs; e < (h + 1) * bs; ++e) isum += code_at<U4>(p, o, e) * a.xq[r * K + b * QB + e];
          const float s = to_float(a.scales[((g * (K / bs)) + b * spb + h) * GROUP + o]);
          acc = std::fma(static_cast<float>(isum), s * a.xd[r * nb + b], acc);
        }
        if constexpr (U4) acc = std::fma(to_float(a.offsets[(g * nb + b) * GROUP + o]), a.xs[r * nb + b], acc);
      }
      a.y[r * a.ystride + g * GROUP + o] = acc;
    }
  }
}

#endif

// f(m) with the activation-row count m = min(nt, TILE_M) as a compile-time constant, so a tile's
// accumulators stay in registers
template <int M, typename F>
inline void with_rows(int64_t nt, F&& f) {
  if constexpr (M > 1) {
    if (nt >= M) return f(std::integral_constant<int, M>{});
    return with_rows<M - 1>(nt, f);
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

template <bool U4, typename S>
void run(const Operands<S>& a, int64_t n, int64_t G) {
  // each task gets enough work to pay for waking a thread; a thread's groups are one contiguous stream
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, a.K * n * GROUP));
  at::parallel_for(0, G, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r0 = 0; r0 < n; r0 += TILE_M)
        with_rows<TILE_M>(n - r0, [&](auto m) { tile<U4, S, decltype(m)::value>(a, g, r0); });
  });
}

// Checks a weight's tensors against the layout: codes [G, K/32, 256 | 512], scales [G, K/bs, 16],
// offsets [G, K/32, 16] for u4; returns G.
int64_t check_weight(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& offsets, int64_t bs,
                     bool u4, int64_t R, int64_t K) {
  TORCH_CHECK(bs == 32 || (bs == 16 && !u4), "block size 32 (or 16 for s8 codes)");
  TORCH_CHECK(K % QB == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && (!u4 || offsets.is_contiguous()),
              "codes, scales and offsets must be contiguous");
  const int64_t G = codes.size(0);
  TORCH_CHECK(codes.dim() == 3 && codes.size(1) == K / QB && codes.size(2) == (u4 ? 256 : 512), "codes: shape");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == G && scales.size(1) == K / bs && scales.size(2) == GROUP,
              "scales: shape");
  TORCH_CHECK(!u4 || (offsets.sizes() == torch::IntArrayRef{G, K / QB, GROUP} && offsets.dtype() == scales.dtype()),
              "offsets: shape or dtype");
  TORCH_CHECK(R <= G * GROUP && R > (G - 1) * GROUP, "rows disagree with the groups");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 || scales.scalar_type() == torch::kFloat32,
              "scales must be float16 or float32");
  return G;
}

// f(u4, scales, offsets) with u4 a std::bool_constant and the scales' element type (uint16_t for float16)
template <typename F>
void typed(const torch::Tensor& scales, const torch::Tensor& offsets, bool u4, F&& f) {
  auto go = [&](const auto* s, const auto* o) {
    if (u4) f(std::true_type{}, s, o);
    else f(std::false_type{}, s, o);
  };
  if (scales.scalar_type() == torch::kFloat16) {
    const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr());
    go(s, u4 ? reinterpret_cast<const uint16_t*>(offsets.data_ptr()) : s);
  } else {
    const float* s = scales.data_ptr<float>();
    go(s, u4 ? offsets.data_ptr<float>() : s);
  }
}

template <typename P>
using elem_t = std::remove_cv_t<std::remove_pointer_t<P>>;

}  // namespace

// y [n, R] float32 = x [n, K] @ W^T, W [R, K] in the grouped layout (codes, scales, offsets as above, the
// offsets ignored for s8), x rounded to 8 bits per block of 32.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bs,
                      bool u4, int64_t R) {
  TORCH_CHECK(x.dim() == 2, "x must be [n, K]");
  x = x.to(torch::kFloat32).contiguous();
  const int64_t n = x.size(0), K = x.size(1), G = check_weight(codes, scales, offsets, bs, u4, R, K);
  const bool padded = G * GROUP != R;
  auto y = torch::empty({n, G * GROUP}, x.options());
  if (n > 0) {
    const Rows8 xr = quantize_rows(x);
    typed(scales, offsets, u4, [&](auto u4c, const auto* s, const auto* o) {
      Operands<elem_t<decltype(s)>> a{reinterpret_cast<const uint8_t*>(codes.data_ptr()), s, o, bs, K,
                                      xr.q.data_ptr<int8_t>(), xr.d.data_ptr<float>(), xr.s.data_ptr<float>(),
                                      xr.c.data_ptr<int32_t>(), y.data_ptr<float>(), G * GROUP};
      run<decltype(u4c)::value>(a, n, G);
    });
  }
  return padded ? y.narrow(1, 0, R).contiguous() : y;
}

// Rows `ids` [m] of the weight, dequantized: [m, K] float32 (an embedding lookup on quantized codes;
// w = scale * q + offset, rounded as QuantWeight.dequantize rounds it).
torch::Tensor dequant_rows(torch::Tensor ids, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                           int64_t bs, bool u4, int64_t R) {
  ids = ids.to(torch::kInt64).contiguous();
  const int64_t K = scales.size(1) * bs, nb = K / QB;
  check_weight(codes, scales, offsets, bs, u4, R, K);
  const int64_t m = ids.size(0);
  auto out = torch::empty({m, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const int64_t* id = ids.data_ptr<int64_t>();
  const uint8_t* w = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  float* y = out.data_ptr<float>();
  typed(scales, offsets, u4, [&](auto u4c, const auto* s, const auto* off) {
    constexpr bool U4 = decltype(u4c)::value;
    for (int64_t j = 0; j < m; ++j) {
      const int64_t row = id[j];
      TORCH_CHECK(row >= 0 && row < R, "row index out of range");
      const int64_t g = row / GROUP, o = row % GROUP;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = w + (g * nb + b) * (U4 ? 256 : 512);
        for (int64_t e = 0; e < QB; ++e) {
          const float sc = to_float(s[(g * (K / bs) + (b * QB + e) / bs) * GROUP + o]);
          float v = sc * static_cast<float>(code_at<U4>(p, o, e));
          if constexpr (U4) v = v + to_float(off[(g * nb + b) * GROUP + o]);
          y[j * K + b * QB + e] = v;
        }
      }
    }
  });
  return out;
}

// The instruction set this build's kernels use.
std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

void register_layer_ops(pybind11::module& m);  // layer_ops.cpp

// The kernels read and write tensors only, never a Python object: the GIL is released while they run,
// so other Python threads (PEARL's draft, a server's other engine) run on the other cores meanwhile.
static const auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_layer_ops(m);
  m.def("qlinear", &qlinear, "x @ W^T on block-quantized W, x rounded to 8 bits per block of 32", kNoGil);
  m.def("dequant_rows", &dequant_rows, "rows of a block-quantized W, dequantized", kNoGil);
  m.def("isa", &isa, "instruction set of this build");
}
