// ZipCache's mixed-precision store (speculum/cache/mixed.py) read where it is stored: the per-piece score and
// value-sum kernels of one chunk part, included by kv_kernels.cpp (after its vectors and Run), which runs them
// as one more kind of piece under its online softmax (zip_attend).
//
// Layout of one part (one precision's tokens of a chunk, k per KV head, in slot order among themselves), per
// KV head; b bits, codes packed planar as in kv_kernels.cpp, a token's d channels one run of d codes:
//   keys:   codes [k, d b/8], minimum and step [d] float16 per channel over the part:
//           k[t, c] = klo[c] + kstep[c] code;
//   values: codes [k, d b/8], minimum and step [k] float16 per token, and the chunk's channel scales [d]
//           float16: v[t, c] = vscale[c] (vlo[t] + vstep[t] code).
// Lanes run over channels (a token's codes are contiguous): a score is q.klo + sum_c (q_c kstep_c) code_c,
// VW tokens' lane sums reduced together; a value sum is vscale (sum_t p_t vlo_t + sum_t (p_t vstep_t) code_t).
#pragma once

// One layer's part of one chunk, every KV head.
struct ZipPart {
  const uint8_t *kc, *vc;                          // [H_kv, k, P] key and value codes (P = d b / 8)
  const c10::Half *klo, *kst, *vlo, *vst, *vscale;  // [H_kv, d], [H_kv, d], [H_kv, k], [H_kv, k], [H_kv, d]
  int64_t k;                                        // tokens per KV head
  Run run;                                          // a token's d codes
  const int32_t* cols;  // [H_kv, k] each token's column (slot - start; < 0: before start, not read), or null
};

// Rows r0 .. r0+M-1 over up to VW tokens of a part (nt of them, kc the first one's codes; the rest score 0):
// S[r, t] = bias[r] + sum_c QS[r, c] code(t, c)
template <int MODE, int K, int M>
inline void zip_scores(const Run& run, const uint8_t* kc, int64_t nt, int64_t d, const float* QS, const float* bias,
                       float* S, int64_t sp) {
  vf tmp[M][VW];
  for (int t = 0; t < VW; ++t) {
    vf acc[M];
    for (int m = 0; m < M; ++m) acc[m] = vzero();
    if (t < nt) {
      const uint8_t* p = kc + t * run.P;
      for (int64_t j = 0; j < run.chunks; ++j) {
        const vi x = load_chunk<MODE>(p + run.off(j));
        for (int k = 0; k < K; ++k) {
          const vf v = codes(x, run.shift[k], run.bits);
          const int64_t c = run.first(j, k);
          for (int m = 0; m < M; ++m) acc[m] = vfma(vload(QS + m * d + c), v, acc[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) tmp[m][t] = acc[m];
  }
  for (int m = 0; m < M; ++m) vstore(S + m * sp, vadd(reduce_lanes(tmp[m]), vset(bias[m])));
}

// Rows r0 .. r0+M-1, the K channel vectors of chunk j of a part's values (vc: the piece's first token's
// codes): O[r, c] = O[r, c] alpha[r] + vscale[c] (los[r] + sum_t PS[r, t] code(t, c)), PS rows sp apart
template <int MODE, int K, int M>
inline void zip_values(const Run& run, int64_t j, const uint8_t* vc, int64_t len, const float* PS, int64_t sp,
                       const float* los, const float* alpha, const c10::Half* vscale, float* O, int64_t d) {
  vf acc[M][K];
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) acc[m][k] = vset(los[m]);
  const uint8_t* p = vc + run.off(j);
  for (int64_t t = 0; t < len; ++t, p += run.P) {
    const vi x = load_chunk<MODE>(p);
    vf v[K];
    for (int k = 0; k < K; ++k) v[k] = codes(x, run.shift[k], run.bits);
    for (int m = 0; m < M; ++m) {
      const vf w = vset(PS[m * sp + t]);
      for (int k = 0; k < K; ++k) acc[m][k] = vfma(w, v[k], acc[m][k]);
    }
  }
  for (int k = 0; k < K; ++k) {
    const int64_t c = run.first(j, k);
    const vf sc = vload(vscale + c);
    for (int m = 0; m < M; ++m) vstore(O + m * d + c, vfma(sc, acc[m][k], vmul(vload(O + m * d + c), vset(alpha[m]))));
  }
}
