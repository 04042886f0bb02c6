// graphtrain's CPU attention kernels (kernels/attention.py chooses them; their contracts are in _cpu_attention.py).
// Why C++: aten has no kernel that fuses scale, mask, softmax and dropout over the scores in place, nor one that skips
// a causal block's unseen keys at these lengths (measurements below).
#include "common.h"
#include "gt_contracts.h"  // generated when the extension is built (kernels/contract.py)

// Attention's elementwise middle, between the batched matmuls that the caller runs with aten (MKL /
// oneDNN, AMX for bf16): scores [BH, Sq, Sk] (q's dtype, contiguous) -> scale, additive mask
// (expanded to [B, H, Sq, Sk], any strides) or causal (j > i, top-left), softmax in fp32, dropout
// from the hash. One row per iteration in an fp32 scratch row, so every pass is a vectorised loop.
// The forward writes the dropped probabilities over the scores (the [Sq, Sk] tensor is transient:
// nothing of that size is saved for backward, which recomputes the scores from q and k).
// Causal (top-left): row i attends keys 0..i, so only its first i + 1 entries are computed; the rest of the
// row is written as 0 (probability and gradient), what exp(-inf) gave when the whole row was computed.
static inline int64_t causal_len(bool causal, int64_t i, int64_t sk) { return causal ? std::min(sk, i + 1) : sk; }

// v[0..sk) = scores * scale + mask, for the first sk entries of a row (the caller's causal_len).
template <typename T>
static inline void attn_row_logits(const T* srow, const T* mask, int64_t ms3, int64_t sk, float scale, float* v) {
  const float* sf = as_f32(srow, sk, v);
  _Pragma("omp simd")
  for (int64_t j = 0; j < sk; ++j) v[j] = sf[j] * scale;
  if (mask != nullptr) {
    if (ms3 == 1) {
      float mb[GT_CHUNK];
      for (int64_t j0 = 0; j0 < sk; j0 += GT_CHUNK) {
        const int64_t len = std::min(GT_CHUNK, sk - j0);
        const float* mf = as_f32(mask + j0, len, mb);
        _Pragma("omp simd")
        for (int64_t j = 0; j < len; ++j) v[j0 + j] += mf[j];
      }
    } else {
      for (int64_t j = 0; j < sk; ++j) v[j] += (float)mask[j * ms3];
    }
  }
}

template <typename T>
static const T* mask_row(const torch::Tensor& mask, int64_t r, int64_t H, int64_t sq) {
  if (mask.numel() == 0) return nullptr;
  const int64_t bh = r / sq, i = r % sq;
  return mask.data_ptr<T>() + (bh / H) * mask.stride(0) + (bh % H) * mask.stride(1) + i * mask.stride(2);
}

// In place: scores -> dropout(softmax(scores * scale + mask)); returns {probs, lse [BH, Sq] fp32}
// (lse = +inf on fully masked rows, whose probabilities are 0, as aten._safe_softmax).
std::vector<torch::Tensor> attn_probs_fwd(torch::Tensor s, torch::Tensor mask, int64_t heads, double scale,
                                          bool causal, double p, int64_t seed) {
  gt_check_attn_probs_fwd(s, mask, heads);
  const int64_t BH = s.size(0), sq = s.size(1), sk = s.size(2);
  auto lse = torch::empty({BH, sq}, s.options().dtype(torch::kFloat));
  const DropSpec drop(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, s.scalar_type(), "attn_probs_fwd", [&] {
    scalar_t* sp = s.data_ptr<scalar_t>();
    float* lp = lse.data_ptr<float>();
    const int64_t ms3 = mask.numel() ? mask.stride(3) : 0;
    at::parallel_for(0, BH * sq, std::max<int64_t>(1, 16384 / sk), [&](int64_t r0, int64_t r1) {
      std::vector<float> v(sk), keep(sk);
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* row = sp + r * sk;
        const int64_t n = causal_len(causal, r % sq, sk);
        attn_row_logits(row, mask_row<scalar_t>(mask, r, heads, sq), ms3, n, (float)scale, v.data());
        float m = -INFINITY;
        _Pragma("omp simd reduction(max:m)")
        for (int64_t j = 0; j < n; ++j) m = v[j] > m ? v[j] : m;
        const float mm = std::isinf(m) ? 0.f : m;  // fully masked row: every exp is 0
        float l = 0.f;
        _Pragma("omp simd reduction(+:l)")
        for (int64_t j = 0; j < n; ++j) { v[j] = gt_exp(v[j] - mm); l += v[j]; }
        lp[r] = l > 0.f ? mm + std::log(l) : INFINITY;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        if (drop.on) keep_block((uint64_t)seed, (uint64_t)r * sk, n, drop.thr, drop.scale * inv, keep.data());
        else std::fill(keep.begin(), keep.begin() + n, inv);
        _Pragma("omp simd")
        for (int64_t j = 0; j < n; ++j) v[j] *= keep[j];
        store_f32(v.data(), row, n);
        std::fill(row + n, row + sk, static_cast<scalar_t>(0.f));
      }
    });
  });
  return {s, lse};
}

// In place, from recomputed scores s and dP' = dO @ V^T: s -> P' (dropped probabilities, for dV),
// dp -> dS * scale (for dQ = dS K and dK = dS^T Q), with dS = P * (dP' * keep - delta).
// delta = rowsum(dO * O) (given) or, with an empty delta, rowsum(P' * dP') from the row itself: the same number in
// exact arithmetic, but bf16/fp16 dP' comes out of its matmul rounded, and only a delta of the same rounded row
// cancels it where a peaked softmax makes dS small (as eager's softmax backward does). Measured by the fuzzing
// (tests/test_fuzz_attention.py): with delta from O, bf16 dq and dk were off by ~30x their size on a peaked row.
void attn_probs_bwd(torch::Tensor s, torch::Tensor dp, torch::Tensor mask, torch::Tensor lse, torch::Tensor delta,
                    int64_t heads, double scale, bool causal, double p, int64_t seed) {
  gt_check_attn_probs_bwd(s, dp, mask, lse, delta, heads);
  const int64_t BH = s.size(0), sq = s.size(1), sk = s.size(2);
  const DropSpec drop(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, s.scalar_type(), "attn_probs_bwd", [&] {
    scalar_t* sp = s.data_ptr<scalar_t>();
    scalar_t* dpp = dp.data_ptr<scalar_t>();
    const float* lp = lse.data_ptr<float>();
    const float* dl = delta.numel() ? delta.data_ptr<float>() : nullptr;
    const int64_t ms3 = mask.numel() ? mask.stride(3) : 0;
    at::parallel_for(0, BH * sq, std::max<int64_t>(1, 16384 / sk), [&](int64_t r0, int64_t r1) {
      std::vector<float> v(sk), keep(sk), d(sk), out(sk);
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* row = sp + r * sk;
        scalar_t* drow = dpp + r * sk;
        const int64_t n = causal_len(causal, r % sq, sk);
        attn_row_logits(row, mask_row<scalar_t>(mask, r, heads, sq), ms3, n, (float)scale, v.data());
        const float lse_r = lp[r], fs = (float)scale;
        if (drop.on) keep_block((uint64_t)seed, (uint64_t)r * sk, n, drop.thr, drop.scale, keep.data());
        else std::fill(keep.begin(), keep.begin() + n, 1.f);
        const float* df = as_f32(drow, n, d.data());
        _Pragma("omp simd")
        for (int64_t j = 0; j < n; ++j) v[j] = std::isinf(lse_r) ? 0.f : gt_exp(v[j] - lse_r);
        float delta_r = dl != nullptr ? dl[r] : 0.f;
        if (dl == nullptr) {
          _Pragma("omp simd reduction(+:delta_r)")
          for (int64_t j = 0; j < n; ++j) delta_r += v[j] * keep[j] * df[j];
        }
        _Pragma("omp simd")
        for (int64_t j = 0; j < n; ++j) {
          const float pr = v[j];
          out[j] = pr * (df[j] * keep[j] - delta_r) * fs;
          v[j] = pr * keep[j];
        }
        store_f32(v.data(), row, n);
        store_f32(out.data(), drow, n);
        std::fill(row + n, row + sk, static_cast<scalar_t>(0.f));
        std::fill(drow + n, drow + sk, static_cast<scalar_t>(0.f));
      }
    });
  });
}

// Attention head by head, for fp32 without a mask (causal or not, dropout or not; kernels/attention.py decides
// which calls come here). Hand-written because no library kernel skips what it can here: aten's CPU flash kernel
// computes a causal row's whole [Sq, Sk] tile at these lengths, and the batched-matmul path above needs
// [B*H, S, S] scores and contiguous heads.
// Here each thread takes whole heads (at::parallel_for over B*H) and, for each block of QB query rows, runs the
// single-threaded BLAS GEMMs (MKL's sgemm_, which libtorch_cpu exports; inside the parallel region it runs on the
// calling thread) on the keys that block can see: for causal attention the blocks above the diagonal are never
// computed. q, k, v are read in place through their strides (a [B, S, H, D] tensor viewed as [B, H, S, D] needs no
// copy); outputs are written through their strides too. Dropout draws the keep mask of element
// (bh * Sq + i) * Sk + j from the hash, as attn_probs_fwd/_bwd do, so both paths drop the same entries. Measured on the 2-core Zen 4 against
// aten's flash kernel (forward + backward, causal, fp32, [B, S, H, D] inputs): [8, 8, 128, 64] 7.1 against 10.5 ms,
// [16, 4, 128, 64] 8.5 against 11.4 ms, [2, 8, 1024, 64] 62.9 against 77.9 ms.
// The Fortran BLAS entry with 32-bit integers (LP64), as torch's own CPU BLAS code declares and calls it; weak, so
// that a build without it loads and attn_heads_available() says no.
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*) __attribute__((weak));

bool attn_heads_available() { return &sgemm_ != nullptr; }

// row-major C[M, N] = alpha * op(A) op(B) + beta * C through the column-major BLAS (C^T = op(B)^T op(A)^T)
static inline void rm_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const char a = tb ? 'T' : 'N', b = ta ? 'T' : 'N';
  const int m = (int)N, n = (int)M, k = (int)K, la = (int)ldb, lb = (int)lda, lc = (int)ldc;
  sgemm_(&a, &b, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

// Per-thread scratch that only grows: a malloc/free of it in every call, inside the parallel region, landed between
// the step's large freed blocks in glibc's heap, so they no longer fitted their next request and came back as fresh
// pages (HF Llama small: the embedding gradient's 32 MB zero-fill took 19 ms a step instead of 0.6).
static float* heads_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if ((int64_t)buf.size() < n) buf.resize(n);
  return buf.data();
}

static inline const float* head_ptr(const torch::Tensor& t, int64_t b, int64_t h) {
  return t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1);
}

// Grouped-query attention: k and v have Hkv heads, a divisor of q's H; query head h reads key/value head
// h / (H / Hkv), as SDPA's enable_gqa does.
// Writes out [B, H, Sq, Dv] (any strides, unit in Dv); returns lse [B, H, Sq] fp32.
torch::Tensor attn_heads_fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale,
                             bool causal, double p, int64_t seed, int64_t qb) {
  gt_check_attn_heads_fwd(q, k, v, out, qb);
  TORCH_CHECK(&sgemm_ != nullptr, "attn_heads_fwd: this torch build exports no sgemm_");
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2), Dv = v.size(3);
  const int64_t G = H / k.size(1);  // query heads per key/value head
  auto lse = torch::empty({B, H, Sq}, q.options());
  const DropSpec drop(p);
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
    float* const S = heads_scratch(qb * Sk + Sk);
    float* const keep = S + qb * Sk;
    for (int64_t bh = h0; bh < h1; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float *Q = head_ptr(q, b, h), *K = head_ptr(k, b, h / G), *V = head_ptr(v, b, h / G);
      float* O = const_cast<float*>(head_ptr(out, b, h));
      const int64_t ostr = out.stride(2);
      for (int64_t i0 = 0; i0 < Sq; i0 += qb) {
        const int64_t rows = std::min(qb, Sq - i0);
        const int64_t kend = causal ? std::min(Sk, i0 + rows) : Sk;  // the keys this block's rows can see
        rm_gemm(false, true, rows, kend, D, (float)scale, Q + i0 * q.stride(2), q.stride(2), K, k.stride(2), 0.f,
                S, Sk);
        for (int64_t r = 0; r < rows; ++r) {
          float* s = S + r * Sk;
          const int64_t n = causal ? std::min(kend, i0 + r + 1) : kend;
          float m = -INFINITY;
          _Pragma("omp simd reduction(max:m)")
          for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
          float l = 0.f;
          _Pragma("omp simd reduction(+:l)")
          for (int64_t j = 0; j < n; ++j) { s[j] = gt_exp(s[j] - m); l += s[j]; }
          lp[bh * Sq + i0 + r] = m + std::log(l);
          const float inv = 1.f / l;
          if (drop.on) {
            keep_block((uint64_t)seed, (uint64_t)(bh * Sq + i0 + r) * Sk, n, drop.thr, drop.scale * inv, keep);
            _Pragma("omp simd")
            for (int64_t j = 0; j < n; ++j) s[j] *= keep[j];
          } else {
            _Pragma("omp simd")
            for (int64_t j = 0; j < n; ++j) s[j] *= inv;
          }
          std::fill(s + n, s + kend, 0.f);
        }
        rm_gemm(false, false, rows, Dv, kend, 1.f, S, Sk, V, v.stride(2), 0.f, O + i0 * ostr, ostr);
      }
    }
  });
  return lse;
}

// Writes dq, dk, dv (shaped as q, k, v; any strides, unit in D). out and lse as attn_heads_fwd left them.
// Each thread takes whole key/value heads and, for each, the G query heads that read it, one after the other: the
// G heads' contributions to dK and dV add up in place, with no other thread writing them.
void attn_heads_bwd(torch::Tensor dout, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                    torch::Tensor lse, torch::Tensor dq, torch::Tensor dk, torch::Tensor dv, double scale, bool causal,
                    double p, int64_t seed, int64_t qb) {
  gt_check_attn_heads_bwd(dout, q, k, v, out, lse, dq, dk, dv, qb);
  TORCH_CHECK(&sgemm_ != nullptr, "attn_heads_bwd: this torch build exports no sgemm_");
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2), Dv = v.size(3);
  const int64_t Hkv = k.size(1), G = H / Hkv;
  const DropSpec drop(p);
  const float fs = (float)scale;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t g0, int64_t g1) {
    float* const S = heads_scratch(2 * qb * Sk + Sk);
    float* const dP = S + qb * Sk;
    float* const keep = dP + qb * Sk;
    auto zero_rows = [](float* t, int64_t r0, int64_t r1, int64_t ld, int64_t n) {
      for (int64_t r = r0; r < r1; ++r) std::fill(t + r * ld, t + r * ld + n, 0.f);
    };
    for (int64_t bg = g0; bg < g1; ++bg) {
      const int64_t b = bg / Hkv, hk = bg % Hkv;
      const float *K = head_ptr(k, b, hk), *V = head_ptr(v, b, hk);
      float* dK = const_cast<float*>(head_ptr(dk, b, hk));
      float* dV = const_cast<float*>(head_ptr(dv, b, hk));
      const int64_t ks = k.stride(2), vs = v.stride(2), dks = dk.stride(2), dvs = dv.stride(2);
      const int64_t nblk = (Sq + qb - 1) / qb;
      if (nblk == 0) { zero_rows(dK, 0, Sk, dks, D); zero_rows(dV, 0, Sk, dvs, Dv); }
      for (int64_t gi = 0; gi < G; ++gi) {
        const int64_t h = hk * G + gi, bh = b * H + h;
        const float *Q = head_ptr(q, b, h), *O = head_ptr(out, b, h), *dO = head_ptr(dout, b, h);
        const int64_t qs = q.stride(2), os = out.stride(2), ds = dout.stride(2), dqs = dq.stride(2);
        float* dQ = const_cast<float*>(head_ptr(dq, b, h));
        const float* L = lse.data_ptr<float>() + bh * Sq;
        // The first query head's last block first: under causal attention it sees every key, so its GEMMs (beta 0)
        // initialise all of dK and dV; every other block accumulates into the keys it sees.
        for (int64_t bi = nblk - 1; bi >= 0; --bi) {
          const int64_t i0 = bi * qb, rows = std::min(qb, Sq - i0);
          const int64_t kend = causal ? std::min(Sk, i0 + rows) : Sk;
          rm_gemm(false, true, rows, kend, D, fs, Q + i0 * qs, qs, K, ks, 0.f, S, Sk);
          rm_gemm(false, true, rows, kend, Dv, 1.f, dO + i0 * ds, ds, V, vs, 0.f, dP, Sk);
          for (int64_t r = 0; r < rows; ++r) {
            const float *orow = O + (i0 + r) * os, *drow = dO + (i0 + r) * ds;
            float delta = 0.f;  // rowsum(dO * O) = rowsum(P * dP')
            _Pragma("omp simd reduction(+:delta)")
            for (int64_t j = 0; j < Dv; ++j) delta += orow[j] * drow[j];
            float *sr = S + r * Sk, *dp = dP + r * Sk;
            const int64_t n = causal ? std::min(kend, i0 + r + 1) : kend;
            const float lr = L[i0 + r];
            if (drop.on) keep_block((uint64_t)seed, (uint64_t)(bh * Sq + i0 + r) * Sk, n, drop.thr, drop.scale, keep);
            else std::fill(keep, keep + n, 1.f);
            _Pragma("omp simd")
            for (int64_t j = 0; j < n; ++j) {
              const float pr = gt_exp(sr[j] - lr);
              dp[j] = pr * (dp[j] * keep[j] - delta) * fs;  // dS * scale, for dQ and dK
              sr[j] = pr * keep[j];                          // the dropped probabilities, for dV
            }
            std::fill(sr + n, sr + kend, 0.f);
            std::fill(dp + n, dp + kend, 0.f);
          }
          const bool first = gi == 0 && bi == nblk - 1;
          const float beta = first ? 0.f : 1.f;
          rm_gemm(true, false, kend, Dv, rows, 1.f, S, Sk, dO + i0 * ds, ds, beta, dV, dvs);
          rm_gemm(false, false, rows, D, kend, 1.f, dP, Sk, K, ks, 0.f, dQ + i0 * dqs, dqs);
          rm_gemm(true, false, kend, D, rows, 1.f, dP, Sk, Q + i0 * qs, qs, beta, dK, dks);
          if (first && kend < Sk) {  // keys no query sees (causal with Sq < Sk): no gradient
            zero_rows(dV, kend, Sk, dvs, Dv);
            zero_rows(dK, kend, Sk, dks, D);
          }
        }
      }
    }
  });
}
