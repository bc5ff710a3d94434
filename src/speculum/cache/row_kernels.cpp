// Per-query-row selection for the decode-time sparse-read KV policies (speculum/kv/rows.py): what each
// row of a step chooses to read, computed in one pass instead of a chain of torch operations over
// [heads, rows, columns] tensors (each a dispatch and an allocation; at one decode row and a few
// thousand columns those, not the arithmetic, were the cost).
//
// - row_topk: per row, the k best candidate columns of a score vector (ties to the lower column), as a
//   bool mask; every candidate where a row has k or fewer. A partial selection (nth_element) over the
//   candidates only, instead of masking, sorting or topk-ing the whole row and scattering back.
// - row_reads: a step's per-row choices -> the committed slots to read per KV head (the union of its
//   rows' choices, increasing, padded with unchosen slots to a common count) and each row's mask over
//   those slots and the step's new entries (the row itself added).
// - hip_search: HiP's hierarchical block search (speculum/kv/hip.py) per KV head and row, the
//   representative keys read in place: each level splits the kept ranges in two, scores each half by
//   its centre key and keeps the best k, until every kept range is one block.
//
// Both are exact (no arithmetic on the scores): a row's result depends on its own scores and candidates
// only, never on the other rows, so a tree step chooses what one-token steps choose.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

void check(const torch::Tensor& t, const char* name, torch::ScalarType type, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == type, name, " has the wrong dtype");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions");
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
    std::vector<float> val(C);
    for (int64_t r = begin; r < end; ++r) {
      const float* s = S + r * C;
      const bool* m = M + (Bc == 1 ? r % n : r) * C;
      bool* o = O + r * C;
      idx.clear();
      for (int64_t c = 0; c < C; ++c)
        if (m[c]) {
          idx.push_back(static_cast<int32_t>(c));
          val[c] = std::isnan(s[c]) ? -std::numeric_limits<float>::infinity() : s[c];
        }
      if (static_cast<int64_t>(idx.size()) > k) {
        auto better = [&](int32_t a, int32_t b) { return val[a] > val[b] || (val[a] == val[b] && a < b); };
        std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
        idx.resize(k);
      }
      for (int32_t c : idx) o[c] = true;
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

template <typename T>
float dot(const float* q, const T* k, int64_t d) {
  float acc = 0.0f;
  for (int64_t c = 0; c < d; ++c) acc += q[c] * static_cast<float>(k[c]);
  return acc;
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
  const int64_t g = H / Hkv, C = L + n;
  at::parallel_for(0, Hkv * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> lo(kb), hi(kb), hlo(2 * kb), hhi(2 * kb);
    std::vector<float> score(2 * kb);
    std::vector<int32_t> order(2 * kb);
    for (int64_t item = begin; item < end; ++item) {
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
        for (int64_t j = 0; j < 2 * kb; ++j) {
          const int64_t first = hlo[j] * block, last = std::min(hhi[j] * block, sp);
          if (last <= first) {
            score[j] = -std::numeric_limits<float>::infinity();
            continue;
          }
          const T* key = kh + column(sinks + (first + last - 1) / 2) * d;
          float best = -std::numeric_limits<float>::infinity();
          for (int64_t r = 0; r < g; ++r) best = std::max(best, dot(qi + r * d, key, d));
          score[j] = best;
        }
        for (int64_t j = 0; j < 2 * kb; ++j) order[j] = static_cast<int32_t>(j);
        std::nth_element(order.begin(), order.begin() + kb, order.end(), [&](int32_t a, int32_t b) {
          return score[a] > score[b] || (score[a] == score[b] && a < b);
        });
        std::sort(order.begin(), order.begin() + kb);  // kept halves in their order (start halves, then mid)
        split = false;
        for (int64_t j = 0; j < kb; ++j) {
          lo[j] = hlo[order[j]], hi[j] = hhi[order[j]];
          split |= hi[j] - lo[j] > 1;
        }
      }
      bool* o = out + (h * n + i) * C;
      for (int64_t j = 0; j < kb; ++j) {
        if (hi[j] <= lo[j]) continue;
        for (int64_t t = lo[j] * block; t < std::min(hi[j] * block, sp); ++t) o[column(sinks + t)] = true;
      }
    }
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_topk", &row_topk, "per row, the k best candidate columns (ties to the lower column) as a bool mask");
  m.def("hip_search", &hip_search, "HiP's hierarchical block search per KV head and row, keys read in place");
  m.def("row_reads", &row_reads, "per-row choices -> committed slots per KV head and each row's mask");
}
