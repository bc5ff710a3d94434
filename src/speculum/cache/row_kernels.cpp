// Per-query-row selection for the decode-time sparse-read KV policies (speculum/kv/rows.py): what each
// row of a step chooses to read, computed in one pass instead of a chain of torch operations over
// [heads, rows, columns] tensors (each a dispatch and an allocation; at one decode row and a few
// thousand columns those, not the arithmetic, were the cost).
//
// - row_topk: per row, the k best candidate columns of a score vector (ties to the lower column), as a
//   bool mask; every candidate where a row has k or fewer. A partial selection (best_k) over the
//   candidates only, instead of masking, sorting or topk-ing the whole row and scattering back.
// - row_reads: a step's per-row choices -> the committed slots to read per KV head (the union of its
//   rows' choices, increasing, padded with unchosen slots to a common count) and each row's mask over
//   those slots and the step's new entries (the row itself added).
// - hip_search: HiP's hierarchical block search (speculum/kv/hip.py) per KV head and row, the
//   representative keys read in place: each level splits the kept ranges in two, scores each half by
//   its centre key and keeps the best k, until every kept range is one block.
// - quest_select: Quest's page choice (speculum/kv/quest.py) per KV head and row: each completed page's
//   bound from its stored key minimum and maximum (or, for a page the row's tree ancestors complete, from
//   its keys), the best pages and the unfinished one, as the tokens to read.
//
// A row's result depends on its own query, scores and candidates only (the same arithmetic, in the same
// order, whatever the step's other rows), so a tree step chooses what one-token steps choose.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

void check(const torch::Tensor& t, const char* name, torch::ScalarType type, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == type, name, " has the wrong dtype");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions");
}

// Calls keep(j), in increasing j, for the k best of score[0 .. m) (NaN counted as -inf; every j where m <= k):
// each score above the k-th best, and the earliest of those equal to it (ties to the earlier index).
// `sorted` is scratch of at least m floats.
template <typename F>
void best_k(float* score, int64_t m, int64_t k, float* sorted, F&& keep) {
  for (int64_t j = 0; j < m; ++j)
    if (std::isnan(score[j])) score[j] = -std::numeric_limits<float>::infinity();
  if (m <= k) {
    for (int64_t j = 0; j < m; ++j) keep(j);
    return;
  }
  if (k <= 0) return;
  std::copy(score, score + m, sorted);
  std::nth_element(sorted, sorted + (k - 1), sorted + m, std::greater<float>());
  const float kth = sorted[k - 1];
  int64_t ties = k;
  for (int64_t j = 0; j < m; ++j) ties -= score[j] > kth;
  for (int64_t j = 0; j < m; ++j)
    if (score[j] > kth || (score[j] == kth && ties-- > 0)) keep(j);
}

// scores float32 [B, n, C]; candidates bool [1 | B, n, C] -> bool [B, n, C]: per (b, i) the k candidate
// columns with the largest scores (a NaN counts as -inf), ties to the lower column.
torch::Tensor row_topk(torch::Tensor scores, torch::Tensor candidates, int64_t k) {
  check(scores, "scores", torch::kFloat32, 3);
  check(candidates, "candidates", torch::kBool, 3);
  const int64_t B = scores.size(0), n = scores.size(1), C = scores.size(2);
  const int64_t Bc = candidates.size(0);
  TORCH_CHECK((Bc == 1 || Bc == B) && candidates.size(1) == n && candidates.size(2) == C,
              "candidates must be [1 or B, n, C] with scores' n and C");
  TORCH_CHECK(k >= 0, "k must be non-negative");
  auto out = torch::zeros({B, n, C}, scores.options().dtype(torch::kBool));
  const float* S = scores.data_ptr<float>();
  const bool* M = candidates.data_ptr<bool>();
  bool* O = out.data_ptr<bool>();
  at::parallel_for(0, B * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> idx;
    std::vector<float> val, sorted;
    for (int64_t r = begin; r < end; ++r) {
      const float* s = S + r * C;
      const bool* m = M + (Bc == 1 ? r % n : r) * C;
      bool* o = O + r * C;
      idx.clear(), val.clear();
      for (int64_t c = 0; c < C; ++c)
        if (m[c]) idx.push_back(static_cast<int32_t>(c)), val.push_back(s[c]);
      sorted.resize(val.size());
      best_k(val.data(), static_cast<int64_t>(val.size()), k, sorted.data(), [&](int64_t j) { o[idx[j]] = true; });
    }
  });
  return out;
}

// visible bool [1 | H, n, L + n] (each row's choice over the step's columns: L committed slots, then the n
// new entries) -> (slots int64 [H, m], mask bool [H, n, m + n], in_place): per KV head the committed slots
// some row chose, increasing, padded with the lowest unchosen slots up to m (the largest head's count),
// and each row's mask over those and the new entries, the row itself always visible. in_place: m == L
// (every committed slot is read; slots is then arange(L) per head and the mask is over all columns).
std::tuple<torch::Tensor, torch::Tensor, bool> row_reads(torch::Tensor visible, int64_t L, int64_t H) {
  check(visible, "visible", torch::kBool, 3);
  const int64_t Hv = visible.size(0), n = visible.size(1), C = visible.size(2);
  TORCH_CHECK(Hv == 1 || Hv == H, "visible must be [1 or H_kv, n, L + n]");
  TORCH_CHECK(C == L + n && L >= 0, "visible's columns must be the L committed slots and the n new entries");
  const bool* V = visible.data_ptr<bool>();
  // per head: which committed slots some row reads
  std::vector<uint8_t> used(H * L, 0);
  std::vector<int64_t> count(H, 0);
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      uint8_t* u = used.data() + h * L;
      const bool* vh = V + (Hv == 1 ? 0 : h) * n * C;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < L; ++c) u[c] |= static_cast<uint8_t>(vh[i * C + c]);
      int64_t total = 0;
      for (int64_t c = 0; c < L; ++c) total += u[c];
      count[h] = total;
    }
  });
  const int64_t m = L ? *std::max_element(count.begin(), count.end()) : 0;
  const bool in_place = m == L;
  auto slots = torch::empty({H, m}, visible.options().dtype(torch::kInt64));
  auto mask = torch::empty({H, n, m + n}, visible.options());
  int64_t* P = slots.data_ptr<int64_t>();
  bool* K = mask.data_ptr<bool>();
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      const uint8_t* u = used.data() + h * L;
      int64_t* p = P + h * m;
      int64_t pad = m - count[h], j = 0;
      for (int64_t c = 0; c < L && j < m; ++c)  // chosen slots, and the first `pad` unchosen ones, in order
        if (u[c] || pad-- > 0) p[j++] = c;
      const bool* vh = V + (Hv == 1 ? 0 : h) * n * C;
      for (int64_t i = 0; i < n; ++i) {
        const bool* v = vh + i * C;
        bool* k = K + (h * n + i) * (m + n);
        for (int64_t t = 0; t < m; ++t) k[t] = v[p[t]];
        for (int64_t t = 0; t < n; ++t) k[m + t] = v[L + t] || t == i;
      }
    }
  });
  return {slots, mask, in_place};
}

#if defined(__AVX2__) && defined(__FMA__)
// The eight lanes' sum: halves, then pairs, then the last two.
inline float lane_sum(__m256 acc) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

// The largest q.k over the g query rows q [g, d] (float32) for one key k [d]. With AVX2 and FMA, each row's
// sum runs in eight lanes (lane l takes channels l, l + 8, ...), added pairwise at the end; elsewhere one
// running sum per row. Either way a row's score depends on its query and the key alone.
template <typename T>
inline float best_dot(const float* q, int64_t g, const T* k, int64_t d) {
  const float* kf;
  float buf[512];
  if constexpr (std::is_same_v<T, float>) {
    kf = k;
  } else {
    for (int64_t c = 0; c < d; ++c) buf[c] = static_cast<float>(k[c]);
    kf = buf;
  }
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    for (int64_t r = 0; r < g; ++r) {
      const float* qr = q + r * d;
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_loadu_ps(kf));
      for (int64_t c = 8; c < d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + c), _mm256_loadu_ps(kf + c), acc);
      best = std::max(best, lane_sum(acc));
    }
    return best;
  }
#endif
  for (int64_t r = 0; r < g; ++r) {
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += q[r * d + c] * kf[c];
    best = std::max(best, acc);
  }
  return best;
}

// q float32 [n, H, d]; keys [H_kv, slots, d] (one layer's, the step's entries written); span int64 [n]
// (tokens in each row's search, positions sinks .. sinks + span - 1); anc int64 [n, D] (row i's ancestor
// column at position L + t, as RowView.ancestor_columns; D may be 0 where no row reaches past L) ->
// bool [H_kv, n, L + n]: the tokens of each row's k kept blocks of `block` tokens, over the step's
// columns. A half [first, last) (tokens) is scored by its centre key, sinks + (first + last - 1) / 2: the
// largest q.k over the KV head's query heads; empty halves never win; ties go to the earlier half.
template <typename T>
void hip_rows(const float* Q, const T* K, int64_t key_hs, const int64_t* span, const int64_t* anc, int64_t D,
              int64_t n, int64_t H, int64_t Hkv, int64_t d, int64_t L, int64_t kb, int64_t block, int64_t sinks,
              bool* out) {
  const int64_t g = H / Hkv, C = L + n, ahead = 8, key_bytes = d * static_cast<int64_t>(sizeof(T));
  auto search = [&](int64_t item) {  // one (KV head, row)
    std::vector<int64_t> lo(kb), hi(kb), hlo(2 * kb), hhi(2 * kb), centre(2 * kb);
    std::vector<float> score(2 * kb), sorted(2 * kb);
    const int64_t h = item / n, i = item % n, sp = span[i], blocks = (sp + block - 1) / block;
    const float* qi = Q + (i * H + h * g) * d;
    const T* kh = K + h * key_hs;
    auto column = [&](int64_t pos) { return pos < L ? pos : anc[i * D + (pos - L)]; };
    for (int64_t j = 0; j < kb; ++j) lo[j] = j * blocks / kb, hi[j] = (j + 1) * blocks / kb;
    bool split = blocks > kb;  // some range longer than one block
    while (split) {
      for (int64_t j = 0; j < kb; ++j) {
        const int64_t mid = lo[j] + (hi[j] - lo[j] + 1) / 2;
        hlo[j] = lo[j], hhi[j] = mid, hlo[kb + j] = mid, hhi[kb + j] = hi[j];
      }
      for (int64_t j = 0; j < 2 * kb; ++j) {  // each half's centre key, -1 for an empty half
        const int64_t first = hlo[j] * block, last = std::min(hhi[j] * block, sp);
        centre[j] = last <= first ? -1 : column(sinks + (first + last - 1) / 2);
      }
      for (int64_t j = 0; j < 2 * kb; ++j) {
        // the keys lie far apart in memory: fetch a later half's key while this one is scored
        if (j + ahead < 2 * kb && centre[j + ahead] >= 0) {
          const char* next = reinterpret_cast<const char*>(kh + centre[j + ahead] * d);
          for (int64_t b = 0; b < key_bytes; b += 64) __builtin_prefetch(next + b);
        }
        score[j] = centre[j] < 0 ? -std::numeric_limits<float>::infinity() : best_dot(qi, g, kh + centre[j] * d, d);
      }
      // keep the kb best halves, in their order (start halves, then mid)
      split = false;
      int64_t kept = 0;
      best_k(score.data(), 2 * kb, kb, sorted.data(), [&](int64_t j) {
        lo[kept] = hlo[j], hi[kept] = hhi[j];
        split |= hi[kept] - lo[kept] > 1;
        ++kept;
      });
    }
    bool* o = out + (h * n + i) * C;
    for (int64_t j = 0; j < kb; ++j) {
      if (hi[j] <= lo[j]) continue;
      for (int64_t t = lo[j] * block; t < std::min(hi[j] * block, sp); ++t) o[column(sinks + t)] = true;
    }
  };
  at::parallel_for(0, Hkv * n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) search(item);
  });
}

torch::Tensor hip_search(torch::Tensor q, torch::Tensor keys, torch::Tensor span, torch::Tensor anc, int64_t L,
                         int64_t kb, int64_t block, int64_t sinks) {
  check(q, "q", torch::kFloat32, 3);
  check(span, "span", torch::kInt64, 1);
  check(anc, "anc", torch::kInt64, 2);
  TORCH_CHECK(keys.device().is_cpu() && keys.dim() == 3 && keys.stride(2) == 1 && keys.stride(1) == keys.size(2),
              "keys must be a CPU [H_kv, slots, d] with contiguous rows");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), Hkv = keys.size(0);
  TORCH_CHECK(keys.size(2) == d && H % Hkv == 0, "q and keys disagree on d or the head count");
  TORCH_CHECK(span.size(0) == n && anc.size(0) == n, "span and anc must have one entry per row");
  TORCH_CHECK(kb >= 1 && block >= 1 && sinks >= 0 && L >= 0, "bad kb, block, sinks or L");
  TORCH_CHECK(d <= 512, "head size above 512");
  TORCH_CHECK(keys.size(1) >= L + n, "keys hold fewer slots than the step's columns");
  const int64_t* sp = span.data_ptr<int64_t>();
  const int64_t* an = anc.data_ptr<int64_t>();
  const int64_t D = anc.size(1);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sinks + sp[i] <= L + D, "a row's search reaches past its context");
    for (int64_t t = 0; t < D; ++t) TORCH_CHECK(an[i * D + t] >= 0 && an[i * D + t] < L + n, "anc out of range");
  }
  auto out = torch::zeros({Hkv, n, L + n}, q.options().dtype(torch::kBool));
  const int64_t hs = keys.stride(0);
  if (keys.scalar_type() == torch::kFloat32)
    hip_rows(q.data_ptr<float>(), keys.data_ptr<float>(), hs, sp, an, D, n, H, Hkv, d, L, kb, block, sinks,
             out.data_ptr<bool>());
  else if (keys.scalar_type() == torch::kBFloat16)
    hip_rows(q.data_ptr<float>(), keys.data_ptr<c10::BFloat16>(), hs, sp, an, D, n, H, Hkv, d, L, kb, block,
             sinks, out.data_ptr<bool>());
  else if (keys.scalar_type() == torch::kHalf)
    hip_rows(q.data_ptr<float>(), keys.data_ptr<c10::Half>(), hs, sp, an, D, n, H, Hkv, d, L, kb, block, sinks,
             out.data_ptr<bool>());
  else
    TORCH_CHECK(false, "keys must be float32, bfloat16 or float16");
  return out;
}

// Quest's bound of a page's logit for the g query rows q [g, d]: the largest over the rows of
// sum_c max(q_c mn_c, q_c mx_c), mn and mx [d] (float32) the page's channel-wise key minimum and maximum.
// Lanes as in best_dot.
inline float best_bound(const float* q, int64_t g, const float* mn, const float* mx, int64_t d) {
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    for (int64_t r = 0; r < g; ++r) {
      const float* qr = q + r * d;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 qc = _mm256_loadu_ps(qr + c);
        acc = _mm256_add_ps(acc, _mm256_max_ps(_mm256_mul_ps(qc, _mm256_loadu_ps(mn + c)),
                                               _mm256_mul_ps(qc, _mm256_loadu_ps(mx + c))));
      }
      best = std::max(best, lane_sum(acc));
    }
    return best;
  }
#endif
  for (int64_t r = 0; r < g; ++r) {
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += std::max(q[r * d + c] * mn[c], q[r * d + c] * mx[c]);
    best = std::max(best, acc);
  }
  return best;
}

// q float32 [n, H, d]; keys [H_kv, slots, d] (one layer's, the step's entries written); kmin, kmax [H_kv, P, d]
// (the layer's page bounds, the first `done` pages filled); pos int64 [n] each row's position; want int64 [n]
// pages each row reads besides its unfinished one (its page count or more: all of them); anc int64 [n, D]
// (as hip_search's) -> bool [H_kv, n, L + n]: per KV head and row, the tokens of the row's `want` pages of
// highest bound (ties to the earlier page) among its completed pages, and its unfinished page's tokens
// before it. A page some row's ancestors complete in this step (index done or above) takes its bounds from
// its keys, read through the row's columns.
template <typename T>
void quest_rows(const float* Q, const T* K, int64_t key_hs, const T* kmin, const T* kmax, int64_t bound_hs,
                int64_t done, const int64_t* pos, const int64_t* want, const int64_t* anc, int64_t D, int64_t n,
                int64_t H, int64_t Hkv, int64_t d, int64_t L, int64_t page, bool* out) {
  const int64_t g = H / Hkv, C = L + n;
  at::parallel_for(0, Hkv * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score, sorted, mn(d), mx(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / n, i = item % n, mine = pos[i] / page;
      const float* qi = Q + (i * H + h * g) * d;
      auto column = [&](int64_t p) { return p < L ? p : anc[i * D + (p - L)]; };
      score.resize(mine), sorted.resize(mine);
      for (int64_t p = 0; p < mine; ++p) {
        if (p < done) {
          const T* a = kmin + h * bound_hs + p * d;
          const T* b = kmax + h * bound_hs + p * d;
          for (int64_t c = 0; c < d; ++c) mn[c] = static_cast<float>(a[c]), mx[c] = static_cast<float>(b[c]);
        } else {
          std::fill(mn.begin(), mn.end(), std::numeric_limits<float>::infinity());
          std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
          for (int64_t t = p * page; t < (p + 1) * page; ++t) {
            const T* key = K + h * key_hs + column(t) * d;
            for (int64_t c = 0; c < d; ++c) {
              const float v = static_cast<float>(key[c]);
              mn[c] = std::min(mn[c], v), mx[c] = std::max(mx[c], v);
            }
          }
        }
        score[p] = best_bound(qi, g, mn.data(), mx.data(), d);
      }
      bool* o = out + (h * n + i) * C;
      best_k(score.data(), mine, want[i], sorted.data(), [&](int64_t p) {
        for (int64_t t = p * page; t < (p + 1) * page; ++t) o[column(t)] = true;
      });
      for (int64_t t = mine * page; t < pos[i]; ++t) o[column(t)] = true;  // the unfinished page
    }
  });
}

torch::Tensor quest_select(torch::Tensor q, torch::Tensor keys, torch::Tensor kmin, torch::Tensor kmax, int64_t done,
                           torch::Tensor pos, torch::Tensor want, torch::Tensor anc, int64_t L, int64_t page) {
  check(q, "q", torch::kFloat32, 3);
  check(pos, "pos", torch::kInt64, 1);
  check(want, "want", torch::kInt64, 1);
  check(anc, "anc", torch::kInt64, 2);
  check(kmin, "kmin", keys.scalar_type(), 3);
  check(kmax, "kmax", keys.scalar_type(), 3);
  TORCH_CHECK(keys.device().is_cpu() && keys.dim() == 3 && keys.stride(2) == 1 && keys.stride(1) == keys.size(2),
              "keys must be a CPU [H_kv, slots, d] with contiguous rows");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), Hkv = keys.size(0), D = anc.size(1);
  TORCH_CHECK(keys.size(2) == d && H % Hkv == 0, "q and keys disagree on d or the head count");
  TORCH_CHECK(kmin.sizes() == kmax.sizes() && kmin.size(0) == Hkv && kmin.size(2) == d && kmin.size(1) >= done,
              "kmin and kmax must be [H_kv, P >= done, d]");
  TORCH_CHECK(pos.size(0) == n && want.size(0) == n && anc.size(0) == n, "pos, want and anc need one entry per row");
  TORCH_CHECK(page >= 1 && L >= 0 && done >= 0 && done * page <= L, "bad page, L or done");
  TORCH_CHECK(keys.size(1) >= L + n, "keys hold fewer slots than the step's columns");
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* an = anc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(p[i] >= L && p[i] <= L + D, "a row's position lies outside its context");
    for (int64_t t = 0; t < D; ++t) TORCH_CHECK(an[i * D + t] >= 0 && an[i * D + t] < L + n, "anc out of range");
  }
  auto out = torch::zeros({Hkv, n, L + n}, q.options().dtype(torch::kBool));
  auto run = [&](auto* K, auto* mn, auto* mx) {
    quest_rows(q.data_ptr<float>(), K, keys.stride(0), mn, mx, kmin.stride(0), done, p, want.data_ptr<int64_t>(), an,
               D, n, H, Hkv, d, L, page, out.data_ptr<bool>());
  };
  if (keys.scalar_type() == torch::kFloat32)
    run(keys.data_ptr<float>(), kmin.data_ptr<float>(), kmax.data_ptr<float>());
  else if (keys.scalar_type() == torch::kBFloat16)
    run(keys.data_ptr<c10::BFloat16>(), kmin.data_ptr<c10::BFloat16>(), kmax.data_ptr<c10::BFloat16>());
  else if (keys.scalar_type() == torch::kHalf)
    run(keys.data_ptr<c10::Half>(), kmin.data_ptr<c10::Half>(), kmax.data_ptr<c10::Half>());
  else
    TORCH_CHECK(false, "keys must be float32, bfloat16 or float16");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_topk", &row_topk, "per row, the k best candidate columns (ties to the lower column) as a bool mask");
  m.def("hip_search", &hip_search, "HiP's hierarchical block search per KV head and row, keys read in place");
  m.def("quest_select", &quest_select, "Quest's page selection per KV head and row, bounds and keys read in place");
  m.def("row_reads", &row_reads, "per-row choices -> committed slots per KV head and each row's mask");
}
