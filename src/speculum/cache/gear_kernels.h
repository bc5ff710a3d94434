// GEAR's corrections of KIVI's codes (speculum/cache/gear.py) inside the quantized store's pieces, included by
// kv_kernels.cpp (after its vectors), which adds them to a quantized piece's scores and value sums (gear_attend),
// so that GEAR's store is attended in one pass under the online softmax, as KIVI's is.
//
// Per KV head and kind (keys, values), slots of the store read as D + A B with outliers written over:
//   low rank: left factors A by slot, transposed, [r, T_cap] float16 (lanes run over tokens); right factors
//             B [C_cap, r, d] float16 per chunk; the chunk of each token group [T_cap / G]. A key group's
//             scores gain sum_k (q . B_k) A_k[t] (q . B precomputed per row and chunk); a group's value sums
//             gain sum_k (sum_t p_t A_k[t]) B_k.
//   outliers: flat indices (slot d + channel: the entry's index in its chunk plus the chunk's first slot d)
//             increasing, with their corrections delta (exact value minus D + A B there), float32; a piece's
//             outliers are found by bisection: q_c delta added to the score at t, p_t delta to the sum at c.
#pragma once

struct GearTerms {
  int64_t rank = 0;                         // 0: no low-rank term
  const c10::Half* a[2] = {nullptr, nullptr};  // [H_kv, r, T_cap] per kind
  const c10::Half* b[2] = {nullptr, nullptr};  // [H_kv, C_cap, r, d] per kind
  int64_t Tcap = 0, Ccap = 0, c0 = 0, C = 0;   // chunks c0 .. c0 + C - 1 hold the slots read
  const int64_t* which = nullptr;           // [T_cap / G] each group's chunk
  std::vector<float> qb;                    // [H_kv, R, C, r] q . B of the keys' chunks c0 ..
  int64_t K = 0, Kcap = 0;                  // outliers per head and kind in use, allocated
  const int32_t* idx[2] = {nullptr, nullptr};   // [H_kv, K_cap] flat index in the chunk
  const int32_t* base = nullptr;            // [K_cap] the chunk's first flat index
  const float* delta[2] = {nullptr, nullptr};   // [H_kv, K_cap]
  int dshift = -1;                          // log2 d where d is a power of two
};

// outliers [i0, i1) of head h, kind `kind`, whose slots lie in [a, a + len)
inline std::pair<int64_t, int64_t> gear_outliers(const GearTerms& g, int kind, int64_t h, int64_t d, int64_t a,
                                                 int64_t len) {
  const int32_t* idx = g.idx[kind] + h * g.Kcap;
  auto first_at = [&](int64_t flat) {  // the first outlier at or past flat index `flat`
    int64_t lo = 0, hi = g.K;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (static_cast<int64_t>(idx[mid]) + g.base[mid] < flat) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  };
  return {first_at(a * d), first_at((a + len) * d)};
}

inline void gear_split(const GearTerms& g, int64_t flat, int64_t d, int64_t& slot, int64_t& chan) {
  if (g.dshift >= 0) slot = flat >> g.dshift, chan = flat & (d - 1);
  else slot = flat / d, chan = flat % d;
}

// A quantized piece's scores S [R, sp] (keys a .. a + len - 1, whole groups of G) gain the keys' low-rank term
// and outliers; Q [R, d] the head's folded, scaled rows.
inline void gear_scores(const GearTerms& g, int64_t h, int64_t R, int64_t d, int64_t G, int64_t a, int64_t len,
                        const float* Q, float* S, int64_t sp) {
  if (g.rank) {
    const c10::Half* A = g.a[0] + h * g.rank * g.Tcap;
    for (int64_t g0 = 0; g0 < len; g0 += G) {
      const int64_t c = g.which[(a + g0) / G] - g.c0;
      for (int64_t r = 0; r < R; ++r) {
        const float* w = g.qb.data() + ((h * R + r) * g.C + c) * g.rank;
        float* s = S + r * sp + g0;
        for (int64_t t = 0; t < G; t += VW) {
          vf acc = vload(s + t);
          for (int64_t k = 0; k < g.rank; ++k) acc = vfma(vset(w[k]), vload(A + k * g.Tcap + a + g0 + t), acc);
          vstore(s + t, acc);
        }
      }
    }
  }
  const auto [i0, i1] = gear_outliers(g, 0, h, d, a, len);
  const int32_t* idx = g.idx[0] + h * g.Kcap;
  const float* delta = g.delta[0] + h * g.Kcap;
  for (int64_t i = i0; i < i1; ++i) {
    int64_t slot, chan;
    gear_split(g, static_cast<int64_t>(idx[i]) + g.base[i], d, slot, chan);
    for (int64_t r = 0; r < R; ++r) S[r * sp + slot - a] += Q[r * d + chan] * delta[i];
  }
}

// A quantized piece's value sums O [R, d] gain the values' low-rank term and outliers, P [R, sp] its
// probabilities (after the codes' sums: O is already rescaled).
inline void gear_values(const GearTerms& g, int64_t h, int64_t R, int64_t d, int64_t G, int64_t a, int64_t len,
                        const float* P, int64_t sp, float* O) {
  if (g.rank) {
    const c10::Half* A = g.a[1] + h * g.rank * g.Tcap;
    float pa[64];  // (rank <= 64: gear_attend checks)
    const int64_t rank = g.rank;
    for (int64_t g0 = 0; g0 < len; g0 += G) {
      const int64_t c = g.which[(a + g0) / G];
      const c10::Half* B = g.b[1] + (h * g.Ccap + c) * g.rank * d;
      for (int64_t r = 0; r < R; ++r) {
        const float* p = P + r * sp + g0;
        for (int64_t k = 0; k < rank; ++k) {
          vf acc = vzero();
          for (int64_t t = 0; t < G; t += VW) acc = vfma(vload(p + t), vload(A + k * g.Tcap + a + g0 + t), acc);
          pa[k] = hsum(acc);
        }
        float* o = O + r * d;
        for (int64_t c2 = 0; c2 < d; c2 += VW) {
          vf acc = vload(o + c2);
          for (int64_t k = 0; k < rank; ++k) acc = vfma(vset(pa[k]), vload(B + k * d + c2), acc);
          vstore(o + c2, acc);
        }
      }
    }
  }
  const auto [i0, i1] = gear_outliers(g, 1, h, d, a, len);
  const int32_t* idx = g.idx[1] + h * g.Kcap;
  const float* delta = g.delta[1] + h * g.Kcap;
  for (int64_t i = i0; i < i1; ++i) {
    int64_t slot, chan;
    gear_split(g, static_cast<int64_t>(idx[i]) + g.base[i], d, slot, chan);
    for (int64_t r = 0; r < R; ++r) O[r * d + chan] += P[r * sp + slot - a] * delta[i];
  }
}
