// The native decoder's operations between the quantized matrix products, for float32 activations on a
// CPU: RMSNorm with the residual add, rotary embedding (with per-head q/k norms), and attention of
// decode and verification rows over the static KV cache.
//
// Why hand-written: with the weights quantized, a one-token step of a small model spends about as long
// dispatching some twenty small torch operators per layer as in its matrix products. Here a layer's
// glue is three calls.
//
// Every row is computed alone, by the same instructions in the same order whatever the number of rows
// in the call: a norm reduces its row with vector lanes fixed by the element's index; the attention of
// a query lists the cache slots it may see (the mask's finite entries, in slot order) and sums over that
// list with lanes fixed by the position in it. A tree's verification row sees its ancestors after the
// cached prefix, in the order a one-token step sees the same tokens once committed; with row-independent
// matrix products (kernels.cpp) a token's logits then come out bit for bit the same whatever step
// computed them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int64_t VW = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

// exp of 16 values <= 0 (Cephes' expf: range reduction by ln 2, degree-5 polynomial); below -87.3 it is 0
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

// s[0 .. n) <- exp(s - m), n a multiple of VW; returns their sum (lanes by index, then one fixed reduction)
inline float exp_sum(float* s, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
    _mm512_storeu_ps(s + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t VW = 8;

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum8(acc);
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float exp_sum(float* s, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum8(acc);
}

// The eight sums of eight vectors' lanes, each by hsum8()'s very additions ((v0 + v4) + (v2 + v6)) +
// ((v1 + v5) + (v3 + v7)), transposed so that they share the shuffles: -> [sum a[0], ..., sum a[7]]
inline __m256 hsum8x8(const __m256* a) {
  // halves: p = [a[x] lo + hi | a[y] lo + hi] for the pairs (0, 4), (1, 5), (2, 6), (3, 7)
  auto halves = [](__m256 x, __m256 y) {
    return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  };
  const __m256 p04 = halves(a[0], a[4]), p15 = halves(a[1], a[5]), p26 = halves(a[2], a[6]), p37 = halves(a[3], a[7]);
  // (s0 + s2, s1 + s3) of each: lanes [a0 a0 a1 a1 | a4 a4 a5 a5] and [a2 a2 a3 a3 | a6 a6 a7 a7]
  const __m256 q01 = _mm256_add_ps(_mm256_shuffle_ps(p04, p15, 0x44), _mm256_shuffle_ps(p04, p15, 0xEE));
  const __m256 q23 = _mm256_add_ps(_mm256_shuffle_ps(p26, p37, 0x44), _mm256_shuffle_ps(p26, p37, 0xEE));
  // t0 + t1 of each: [a0 a1 a2 a3 | a4 a5 a6 a7]
  return _mm256_add_ps(_mm256_shuffle_ps(q01, q23, 0x88), _mm256_shuffle_ps(q01, q23, 0xDD));
}

// s[t] = dot(q, K + vis[t] * d, d) for t < T, d a multiple of 8: eight keys at a time, eight chains of FMAs
// side by side (a lone dot is one chain of dependent FMAs), each key's sum the very operations of dot().
// Always inlined, so that a call with a constant d gets loops of known length.
__attribute__((always_inline)) inline void eight_key_scores(const float* q, const float* K, const int32_t* vis,
                                                            int64_t T, int64_t d, float* s) {
  int64_t t = 0;
  for (; t + 8 <= T; t += 8) {
    const float* k[8];
    for (int u = 0; u < 8; ++u) k[u] = K + vis[t + u] * d;
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[u] + i), acc[u]);
    }
    _mm256_storeu_ps(s + t, hsum8x8(acc));
  }
  for (; t < T; ++t) s[t] = dot(q, K + vis[t] * d, d);
}

// s[t] <- s[t] * sc + m[vis[t]] (m may be null: no addition) for t < T, the product rounded before the
// addition (as the scalar loop in attend_cache); returns the largest, NaNs skipped as std::max(top, x) skips them
#define SPECULUM_VECTOR_SCALED_SCORES
inline float scaled_scores(float* s, int64_t T, float sc, const float* m, const int32_t* vis) {
  const __m256 vsc = _mm256_set1_ps(sc);
  __m256 vtop = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= T; t += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + t), vsc);
    if (m) {
      asm("" : "+x"(x));  // no fused multiply-add: the product is rounded first
      const __m256 add = vis[t + 7] - vis[t] == 7
                             ? _mm256_loadu_ps(m + vis[t])
                             : _mm256_i32gather_ps(m, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vis + t)), 4);
      x = _mm256_add_ps(x, add);
    }
    _mm256_storeu_ps(s + t, x);
    vtop = _mm256_max_ps(x, vtop);  // a NaN x keeps the running maximum
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vtop);
  float top = -std::numeric_limits<float>::infinity();
  for (float l : lanes) top = std::max(top, l);
  for (; t < T; ++t) {
    float x = s[t] * sc;
    asm("" : "+x"(x));
    if (m) x += m[vis[t]];
    s[t] = x;
    top = std::max(top, x);
  }
  return top;
}

// s[t] = dot(q, K + vis[t] * d, d) for t < T (eight_key_scores where d is a multiple of 8, with the
// model head sizes as constants; the same sums)
#define SPECULUM_BLOCKED_ATTENTION
inline void key_scores(const float* q, const float* K, const int32_t* vis, int64_t T, int64_t d, float* s) {
  switch (d) {
    case 64: return eight_key_scores(q, K, vis, T, 64, s);
    case 128: return eight_key_scores(q, K, vis, T, 128, s);
    case 256: return eight_key_scores(q, K, vis, T, 256, s);
    default: break;
  }
  if (d % 8 == 0) return eight_key_scores(q, K, vis, T, d, s);
  for (int64_t t = 0; t < T; ++t) s[t] = dot(q, K + vis[t] * d, d);
}

// o[0 .. d) += sum over t < T of p[t] * V[vis[t] * d ..], added in t order per element as a chain of
// axpy() calls would, but with 64 outputs held in registers across a run of keys (runs of 256 keys, so
// a run's values stay in L2 while the 64-wide slices of a wide head pass over them)
inline void weighted_values(const float* p, const float* V, const int32_t* vis, int64_t T, int64_t d, float* o) {
  const int64_t wide = d / 64 * 64;
  for (int64_t t0 = 0; t0 < T; t0 += 256) {
    const int64_t t1 = std::min<int64_t>(T, t0 + 256);
    for (int64_t e0 = 0; e0 < wide; e0 += 64) {
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_loadu_ps(o + e0 + 8 * u);
      for (int64_t t = t0; t < t1; ++t) {
        const __m256 w = _mm256_set1_ps(p[t]);
        const float* v = V + vis[t] * d + e0;
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * u), acc[u]);
      }
      for (int u = 0; u < 8; ++u) _mm256_storeu_ps(o + e0 + 8 * u, acc[u]);
    }
    if (wide < d)
      for (int64_t t = t0; t < t1; ++t) axpy(p[t], V + vis[t] * d + wide, o + wide, d - wide);
  }
}

#else
constexpr int64_t VW = 1;

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

inline float exp_sum(float* s, int64_t n, float m) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    acc += s[i];
  }
  return acc;
}
#endif

#ifndef SPECULUM_BLOCKED_ATTENTION
// s[t] = dot(q, K + vis[t] * d, d) for t < T (the AVX2 build blocks four keys, same sums)
inline void key_scores(const float* q, const float* K, const int32_t* vis, int64_t T, int64_t d, float* s) {
  for (int64_t t = 0; t < T; ++t) s[t] = dot(q, K + vis[t] * d, d);
}

// o[0 .. d) += sum over t < T of p[t] * V[vis[t] * d ..], in t order per element
inline void weighted_values(const float* p, const float* V, const int32_t* vis, int64_t T, int64_t d, float* o) {
  for (int64_t t = 0; t < T; ++t) axpy(p[t], V + vis[t] * d, o, d);
}
#endif

// out[D] = x * rsqrt(mean(x^2) + eps) * scale (transformers' RMSNorm in float32, the scale being the
// weight, or 1 + weight for Gemma's)
inline void rms_norm_row(const float* x, const float* scale, float eps, int64_t D, float* out) {
  const float r = 1.0f / std::sqrt(dot(x, x, D) / static_cast<float>(D) + eps);
  for (int64_t j = 0; j < D; ++j) out[j] = (x[j] * r) * scale[j];
}

// rotary embedding of one head x[d] in place: x cos + rotate_half(x) sin
inline void rotate_row(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  float tmp[1024];
  std::copy(x, x + d, tmp);
  for (int64_t j = 0; j < half; ++j) x[j] = tmp[j] * cos[j] - tmp[j + half] * sin[j];
  for (int64_t j = half; j < d; ++j) x[j] = tmp[j] * cos[j] + tmp[j - half] * sin[j];
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(),
              name, " must be a contiguous float32 CPU tensor");
}

}  // namespace

// x [n, D] -> [n, D]: RMSNorm with the float32 scale [D].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor scale, double eps) {
  check_f32(x, "x");
  check_f32(scale, "scale");
  const int64_t n = x.size(0), D = x.size(1);
  TORCH_CHECK(scale.numel() == D, "scale must have one entry per column");
  auto out = torch::empty_like(x);
  for (int64_t i = 0; i < n; ++i)
    rms_norm_row(x.data_ptr<float>() + i * D, scale.data_ptr<float>(), static_cast<float>(eps), D,
                 out.data_ptr<float>() + i * D);
  return out;
}

// The residual add and the next norm: h2 = h + (post_scale given ? norm(a) * post_scale : a), and
// x = norm(h2) * next_scale where next_scale is given (else an empty tensor). h, a [n, D] -> (h2, x).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor a, torch::Tensor post_scale,
                                                      double post_eps, torch::Tensor next_scale, double next_eps) {
  check_f32(h, "h");
  check_f32(a, "a");
  const int64_t n = h.size(0), D = h.size(1);
  TORCH_CHECK(a.size(0) == n && a.size(1) == D, "h and a must have one shape");
  const bool post = post_scale.numel() > 0, next = next_scale.numel() > 0;
  if (post) check_f32(post_scale, "post_scale");
  if (next) check_f32(next_scale, "next_scale");
  auto h2 = torch::empty_like(h);
  auto x = next ? torch::empty_like(h) : torch::empty({0}, h.options());
  std::vector<float> t(post ? D : 0);
  for (int64_t i = 0; i < n; ++i) {
    const float* hr = h.data_ptr<float>() + i * D;
    const float* ar = a.data_ptr<float>() + i * D;
    float* out = h2.data_ptr<float>() + i * D;
    if (post) {
      rms_norm_row(ar, post_scale.data_ptr<float>(), static_cast<float>(post_eps), D, t.data());
      ar = t.data();
    }
    for (int64_t j = 0; j < D; ++j) out[j] = hr[j] + ar[j];
    if (next) rms_norm_row(out, next_scale.data_ptr<float>(), static_cast<float>(next_eps), D, x.data_ptr<float>() + i * D);
  }
  return {h2, x};
}

// The fused QKV product's output [n, (H + 2 H_kv) d] -> q [n, H, d], k, v [n, H_kv, d]: per-head norms on
// q and k where their scales [d] are given (Gemma-3, Qwen3), then the rotary embedding (cos, sin [n, d]).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_qkv(torch::Tensor qkv, torch::Tensor cos,
                                                                 torch::Tensor sin, int64_t H, int64_t Hkv,
                                                                 torch::Tensor q_scale, torch::Tensor k_scale,
                                                                 double eps) {
  check_f32(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  const int64_t n = qkv.size(0), d = cos.size(-1);
  TORCH_CHECK(qkv.numel() == n * (H + 2 * Hkv) * d, "qkv must be [n, (H + 2 H_kv) d]");
  TORCH_CHECK(cos.numel() == n * d && sin.numel() == n * d, "cos and sin must be [n, d]");
  TORCH_CHECK(d % 2 == 0 && d <= 1024, "head dim must be even and at most 1024");
  const bool qn = q_scale.numel() > 0, kn = k_scale.numel() > 0;
  if (qn) check_f32(q_scale, "q_scale");
  if (kn) check_f32(k_scale, "k_scale");
  auto q = torch::empty({n, H, d}, qkv.options());
  auto k = torch::empty({n, Hkv, d}, qkv.options());
  auto v = torch::empty({n, Hkv, d}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float* row = src + i * (H + 2 * Hkv) * d;
    const float* c = cos.data_ptr<float>() + i * d;
    const float* s = sin.data_ptr<float>() + i * d;
    for (int64_t h = 0; h < H + Hkv; ++h) {
      float* out = h < H ? q.data_ptr<float>() + (i * H + h) * d : k.data_ptr<float>() + (i * Hkv + h - H) * d;
      const bool norm = h < H ? qn : kn;
      if (norm) rms_norm_row(row + h * d, (h < H ? q_scale : k_scale).data_ptr<float>(), static_cast<float>(eps), d, out);
      else std::copy(row + h * d, row + (h + 1) * d, out);
      rotate_row(out, c, s, d);
    }
    std::copy(row + (H + Hkv) * d, row + (H + 2 * Hkv) * d, v.data_ptr<float>() + i * Hkv * d);
  }
  return {q, k, v};
}

// Bytes of keys (or values) per block when several query rows share a prefix of the cache (attend_cache):
// a block stays in L1 while every query of the KV head reads it.
static constexpr int64_t kSharedBytes = 16384;

// Writes the new keys and values k, v [n, H_kv, d] into layer `layer` of the cache kv [layers, 2, H_kv, C, d]
// at slots write .. write + n - 1, then attends: q [n, H, d] over slots 0 .. keys - 1, query i seeing the
// slots where the additive mask's row i ([n or g n, >= keys], rows j n + i alike for the g heads of a KV
// group; one row [1, >= keys] for every query) is finite, every slot where `mask` is empty. Scores are q.k * scale, soft-capped (tanh(s / c) c)
// where softcap > 0, plus the mask. -> [n, H d].
torch::Tensor attend_cache(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kv, int64_t layer,
                           int64_t write, int64_t keys, torch::Tensor mask, double scale, double softcap) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  check_f32(kv, "kv");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t Hkv = kv.size(2), C = kv.size(3), g = H / Hkv;
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.size(4) == d && H % Hkv == 0, "kv must be [layers, 2, H_kv, C, d]");
  TORCH_CHECK(k.size(0) == n && k.size(1) == Hkv && k.size(2) == d && v.sizes() == k.sizes(), "k, v must be [n, H_kv, d]");
  TORCH_CHECK(layer >= 0 && layer < kv.size(0) && write >= 0 && write + n <= C && keys >= 0 && keys <= C,
              "cache slots out of range");
  const bool masked = mask.numel() > 0;
  if (masked) {
    check_f32(mask, "mask");
    TORCH_CHECK(mask.dim() == 2 && (mask.size(0) == 1 || mask.size(0) == n || mask.size(0) == g * n) &&
                    mask.size(1) >= keys,
                "mask must be [1, n or g n, >= keys]");
  }
  float* K = kv.data_ptr<float>() + layer * 2 * Hkv * C * d;
  float* V = K + Hkv * C * d;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < Hkv; ++j) {
      std::copy(k.data_ptr<float>() + (i * Hkv + j) * d, k.data_ptr<float>() + (i * Hkv + j + 1) * d, K + (j * C + write + i) * d);
      std::copy(v.data_ptr<float>() + (i * Hkv + j) * d, v.data_ptr<float>() + (i * Hkv + j + 1) * d, V + (j * C + write + i) * d);
    }
  auto mask_row = [&](int64_t i) { return mask.data_ptr<float>() + (mask.size(0) == 1 ? 0 : i) * mask.size(1); };
  // each query's visible slots, in slot order
  std::vector<std::vector<int32_t>> visible(n);
  int64_t most = 0;
  for (int64_t i = 0; i < n; ++i) {
    auto& vis = visible[i];
    vis.reserve(keys);
    const float* m = masked ? mask_row(i) : nullptr;
    for (int64_t t = 0; t < keys; ++t)
      if (!m || m[t] > -std::numeric_limits<float>::infinity()) vis.push_back(static_cast<int32_t>(t));
    most = std::max<int64_t>(most, static_cast<int64_t>(vis.size()));
  }
  auto out = torch::zeros({n, H * d}, q.options());
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t padded = (most + VW - 1) / VW * VW;
  // One query (row i, head h): its scores s over its visible slots (key_scores, already filled) -> softmax
  // weights in place, and the weights' sum.
  auto weigh = [&](int64_t i, float* s) {
    const auto& vis = visible[i];
    const int64_t T = static_cast<int64_t>(vis.size());
    const float* m = masked ? mask_row(i) : nullptr;
    float top = -std::numeric_limits<float>::infinity();
#ifdef SPECULUM_VECTOR_SCALED_SCORES
    if (cap <= 0.0f) top = scaled_scores(s, T, sc, m, vis.data());
    else
#endif
    for (int64_t t = 0; t < T; ++t) {
      float x = s[t] * sc;
      if (cap > 0.0f) x = std::tanh(x / cap) * cap;
      if (m) x += m[vis[t]];
      s[t] = x;
      top = std::max(top, x);
    }
    const int64_t Tp = (T + VW - 1) / VW * VW;
    std::fill(s + T, s + Tp, -std::numeric_limits<float>::infinity());
    return exp_sum(s, Tp, top);
  };
  auto finish = [&](float* o, float total) {
    const float inv = 1.0f / total;
    for (int64_t e = 0; e < d; ++e) o[e] *= inv;
  };
  // the slots 0 .. shared-1 that every row sees, in that order at the start of its visible list
  int64_t shared = most;
  for (int64_t i = 0; i < n; ++i) {
    int64_t t = 0;
    const auto& vis = visible[i];
    while (t < std::min<int64_t>(shared, static_cast<int64_t>(vis.size())) && vis[t] == t) ++t;
    shared = t;
  }
  const int64_t block = std::max<int64_t>(16, kSharedBytes / (d * static_cast<int64_t>(sizeof(float))) / 8 * 8);
  if ((n == 1 && g == 1) || shared < block) {
    // each (row, head) on its own: every query reads its keys and values itself
    const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, most * d));
    at::parallel_for(0, n * H, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> s(std::max<int64_t>(padded, 1));
      for (int64_t item = begin; item < end; ++item) {
        const int64_t i = item / H, h = item % H, j = h / g;
        const auto& vis = visible[i];
        const int64_t T = static_cast<int64_t>(vis.size());
        if (T == 0) continue;  // no visible key: zeros (a padding row)
        key_scores(q.data_ptr<float>() + (i * H + h) * d, K + j * C * d, vis.data(), T, d, s.data());
        const float total = weigh(i, s.data());
        float* o = out.data_ptr<float>() + i * H * d + h * d;
        weighted_values(s.data(), V + j * C * d, vis.data(), T, d, o);  // (out starts as zeros)
        finish(o, total);
      }
    });
    return out;
  }
  // The queries of one KV head over a long shared prefix (the g heads of a group in a decode step; a
  // tree's or chain's rows besides): they take the prefix's keys, then its values, a block of slots at a
  // time, so that a block is read from memory once for all of them (or for each of the few tasks they
  // are split into), not once per query. Each query's arithmetic is the one above: key_scores scores
  // each key alone, exp_sum runs over its whole list, and weighted_values adds the slots in order per
  // output element however the list is cut. The same bits. A KV head's queries are split into the
  // fewest tasks that keep every thread busy (Hkv x chunks a multiple of the threads).
  const int64_t threads = at::get_num_threads(), per_head = n * g;
  const int64_t split = std::min<int64_t>(per_head, threads / std::gcd<int64_t>(Hkv, threads));
  const int64_t chunk = (per_head + split - 1) / split, chunks = (per_head + chunk - 1) / chunk;
  at::parallel_for(0, Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(chunk * std::max<int64_t>(padded, 1));
    std::vector<float> totals(chunk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task / chunks, first = task % chunks * chunk, last = std::min(per_head, first + chunk);
      const float* Kj = K + j * C * d;
      const float* Vj = V + j * C * d;
      // query u of the task: row (first + u) / g, head j g + (first + u) % g
      auto row_of = [&](int64_t u) { return (first + u) / g; };
      auto head_of = [&](int64_t u) { return j * g + (first + u) % g; };
      auto scores = [&](int64_t u) { return s.data() + u * padded; };
      for (int64_t t0 = 0; t0 < shared; t0 += block) {
        const int64_t len = std::min(block, shared - t0);
        for (int64_t u = 0; u < last - first; ++u)
          key_scores(q.data_ptr<float>() + (row_of(u) * H + head_of(u)) * d, Kj, visible[row_of(u)].data() + t0, len, d,
                     scores(u) + t0);
      }
      for (int64_t u = 0; u < last - first; ++u) {
        const auto& vis = visible[row_of(u)];
        const int64_t T = static_cast<int64_t>(vis.size());
        key_scores(q.data_ptr<float>() + (row_of(u) * H + head_of(u)) * d, Kj, vis.data() + shared, T - shared, d,
                   scores(u) + shared);
        totals[u] = weigh(row_of(u), scores(u));
      }
      auto output = [&](int64_t u) { return out.data_ptr<float>() + row_of(u) * H * d + head_of(u) * d; };
      for (int64_t t0 = 0; t0 < shared; t0 += block) {
        const int64_t len = std::min(block, shared - t0);
        for (int64_t u = 0; u < last - first; ++u)
          weighted_values(scores(u) + t0, Vj, visible[row_of(u)].data() + t0, len, d, output(u));
      }
      for (int64_t u = 0; u < last - first; ++u) {
        const auto& vis = visible[row_of(u)];
        const int64_t T = static_cast<int64_t>(vis.size());
        weighted_values(scores(u) + shared, Vj, vis.data() + shared, T - shared, d, output(u));
        finish(output(u), totals[u]);
      }
    }
  });
  return out;
}

namespace {

// v[0 .. n) <- exp(v), every v <= 0
inline void exp_nonpositive(float* v, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, exp16(_mm512_loadu_ps(v + i)));
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
#endif
  for (; i < n; ++i) v[i] = std::exp(v[i]);
}

// The gated activation of a fused gate-up output y [n, 2F] -> [n, F]: act(gate) * up, act SiLU or
// GELU's tanh approximation (gelu_pytorch_tanh), each from an exp of a non-positive argument (sigmoid(g)
// from exp(-|g|), tanh(t) from exp(-2|t|)), so no exp overflows.
torch::Tensor gated_act(const torch::Tensor& y, bool gelu) {
  const int64_t n = y.size(0), F = y.size(1) / 2;
  auto out = torch::empty({n, F}, y.options());
  const float* Y = y.data_ptr<float>();
  float* O = out.data_ptr<float>();
  constexpr float c = 0.7978845608028654f, k = 0.044715f;  // sqrt(2 / pi)
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, F)), [&](int64_t begin, int64_t end) {
    std::vector<float> e(F);
    for (int64_t r = begin; r < end; ++r) {
      const float *g = Y + r * 2 * F, *u = g + F;
      float* o = O + r * F;
      for (int64_t i = 0; i < F; ++i) e[i] = gelu ? -2.0f * std::fabs(c * (g[i] + k * g[i] * g[i] * g[i])) : -std::fabs(g[i]);
      exp_nonpositive(e.data(), F);
      for (int64_t i = 0; i < F; ++i) {
        if (gelu) {
          const float t = c * (g[i] + k * g[i] * g[i] * g[i]);
          const float th = std::copysign((1.0f - e[i]) / (1.0f + e[i]), t);
          o[i] = 0.5f * g[i] * (1.0f + th) * u[i];
        } else {
          const float sig = (g[i] >= 0.0f ? 1.0f : e[i]) / (1.0f + e[i]);
          o[i] = g[i] * sig * u[i];
        }
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bs,
                      bool u4, int64_t R);  // kernels.cpp

namespace {

using QuantArgs = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, bool, int64_t>;

// A quantized MLP in one call: down(act(gate) * up) with the gate and up products fused, x [n, D] -> [n, D];
// each weight as QuantWeight.kernel_args() gives it.
torch::Tensor mlp(torch::Tensor x, const QuantArgs& gate_up, const QuantArgs& down, bool gelu) {
  auto product = [](const torch::Tensor& in, const QuantArgs& w) {
    return qlinear(in, std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w), std::get<4>(w), std::get<5>(w));
  };
  return product(gated_act(product(x, gate_up), gelu), down);
}

// One decoder layer on quantized weights for decode and verification steps, its static parts (norm scales,
// weights, shape) held once: the same calls as the decoder's compiled layer path, in the same order (so
// the same bits), without a Python round trip between them.
struct QuantLayer {
  torch::Tensor in_scale;
  double in_eps;
  QuantArgs qkv;
  int64_t heads, kv_heads;
  torch::Tensor q_scale, k_scale;  // per-head norms, or empty
  double qk_eps;
  int64_t layer;                   // its index in the cache
  double scale, softcap;
  QuantArgs o;
  torch::Tensor post_attn, pre_mlp;  // Gemma: both; Llama: post_attn empty, pre_mlp its post-attention norm
  double post_attn_eps, pre_mlp_eps;
  QuantArgs gate_up, down;
  bool gelu;
  torch::Tensor post_mlp;  // Gemma's, or empty
  double post_mlp_eps;

  // h [n, D] -> the layer's output [n, D]; cos, sin [n, d] of its rotary kind; keys and values written
  // into kv at slots write ..; mask as attend_cache's
  torch::Tensor step(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv, int64_t write,
                     int64_t keys, torch::Tensor mask) const {
    auto product = [](const torch::Tensor& in, const QuantArgs& w) {
      return qlinear(in, std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w), std::get<4>(w),
                     std::get<5>(w));
    };
    h = h.contiguous();
    auto [q, k, v] = rope_qkv(product(rms_norm(h, in_scale, in_eps), qkv), cos, sin, heads, kv_heads, q_scale, k_scale,
                              qk_eps);
    auto a = attend_cache(q, k, v, kv, layer, write, keys, mask, scale, softcap);
    auto [h2, x] = add_rms_norm(h, product(a, o), post_attn, post_attn_eps, pre_mlp, pre_mlp_eps);
    auto out = add_rms_norm(h2, mlp(x, gate_up, down, gelu), post_mlp, post_mlp_eps, torch::empty({0}, h.options()), 0.0);
    return std::get<0>(out);
  }
};

}  // namespace

// The kernels read and write tensors only, never a Python object: the GIL is released while they run,
// so other Python threads (PEARL's draft, a server's other engine) run on the other cores meanwhile.
static const auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();

void register_layer_ops(pybind11::module& m) {
  pybind11::class_<QuantLayer>(m, "QuantLayer")
      .def(pybind11::init([](torch::Tensor in_scale, double in_eps, QuantArgs qkv, int64_t heads, int64_t kv_heads,
                             torch::Tensor q_scale, torch::Tensor k_scale, double qk_eps, int64_t layer, double scale,
                             double softcap, QuantArgs o, torch::Tensor post_attn, torch::Tensor pre_mlp,
                             double post_attn_eps, double pre_mlp_eps, QuantArgs gate_up, QuantArgs down, bool gelu,
                             torch::Tensor post_mlp, double post_mlp_eps) {
             return QuantLayer{in_scale, in_eps, qkv, heads, kv_heads, q_scale, k_scale, qk_eps, layer, scale, softcap,
                               o, post_attn, pre_mlp, post_attn_eps, pre_mlp_eps, gate_up, down, gelu, post_mlp,
                               post_mlp_eps};
           }))
      .def("step", &QuantLayer::step, "one decode or verification step of the layer", kNoGil);
  m.def("mlp", &mlp, "a quantized gated MLP (fused gate-up product, SiLU or GELU-tanh gate, down product)", kNoGil);
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows", kNoGil);
  m.def("add_rms_norm", &add_rms_norm, "residual add (with an optional norm of the addend) and the next norm", kNoGil);
  m.def("rope_qkv", &rope_qkv, "split a fused QKV output, per-head q/k norms, rotary embedding", kNoGil);
  m.def("attend_cache", &attend_cache, "write new keys/values into a static cache and attend over it", kNoGil);
}
