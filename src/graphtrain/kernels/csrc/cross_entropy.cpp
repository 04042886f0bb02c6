// Softmax cross-entropy and its gradient in one pass per row (kernels/cross_entropy.py, linear_cross_entropy.py).
// Why C++: a row stays in cache across its passes, where the torch sequence streams it through memory ~8 times.
#include "common.h"
#include "gt_contracts.h"  // generated when the extension is built (kernels/contract.py)

// Softmax cross-entropy over the rows of x [n, v] (dense rows, row stride >= v: a head's padded logits buffer), in
// place: losses[r] = logsumexp(x[r]) - x[r, t[r]] (0 where t[r] == ignore_index), and x[r] becomes
// (softmax(x[r]) - onehot(t[r])) * scale (all 0 where ignored), i.e. the loss and its gradient in one call. A row
// stays in cache across its passes (max, sum of exp, write), where the torch sequence (logsumexp, gather, sub, exp,
// scatter, mul, cast) streams the chunk through memory about eight times. fp32 math for fp32/bf16/fp16 inputs.
// src_rows: row r reads src[rows[r]] (src [m, v] contiguous, same dtype) and writes x[r] (not read): the rows of a
// head's returned logits go straight from those logits to the gradient, without a copy into x first. Empty rows:
// x is its own source.
static void ce_rows(torch::Tensor x, torch::Tensor src, torch::Tensor rows, torch::Tensor target,
                    int64_t ignore_index, double scale, torch::Tensor losses) {
  // the callers below checked their contracts
  const int64_t n = x.size(0), v = x.size(1), ldx = n > 1 ? x.stride(0) : v;
  const bool gather = rows.numel() > 0;
  const int64_t lds = gather ? v : ldx;  // src is contiguous; without rows, x is its own source
  const int64_t* rp = gather ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; gather && r < n; ++r)
    TORCH_CHECK(rp[r] >= 0 && rp[r] < src.size(0), "ce_fwd_bwd_rows: row ", rp[r], " out of range");
  const int64_t* tp = target.data_ptr<int64_t>();
  float* lp = losses.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(tp[r] == ignore_index || (tp[r] >= 0 && tp[r] < v), "cross_entropy: target ", tp[r],
                " is out of range for ", v, " classes");
  const float sc = (float)scale;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ce_fwd_bwd_inplace", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* sp = gather ? src.data_ptr<scalar_t>() : xp;
    at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(std::is_same_v<scalar_t, float> ? 0 : v);  // fp32 reads the source row itself
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* row = xp + r * ldx;
        const int64_t t = tp[r];
        if (t == ignore_index) {
          lp[r] = 0.f;
          std::memset((void*)row, 0, v * sizeof(scalar_t));
          continue;
        }
        const float* f = as_f32(sp + (gather ? rp[r] : r) * lds, v, buf.data());
        float m = -INFINITY;
_Pragma("omp simd reduction(max:m)")
        for (int64_t j = 0; j < v; ++j) m = f[j] > m ? f[j] : m;
        const float ft = f[t];  // read before g overwrites it (g may be f)
        // exp(f - m) goes to the gradient's row as it is summed, then is scaled: one exp per entry, not two
        // (bf16 [2032, 8192] rows on the 2-core Zen 4: 8.5 ms a call with two). g: in place (x is the source),
        // x's row (fp32 gathered from the returned logits) or the fp32 scratch (bf16/fp16)
        float* g = gather && std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(row) : const_cast<float*>(f);
        float s = 0.f;
_Pragma("omp simd reduction(+:s)")
        for (int64_t j = 0; j < v; ++j) {
          const float e = gt_exp(f[j] - m);
          g[j] = e;
          s += e;
        }
        lp[r] = m + std::log(s) - ft;
        const float k = sc / s;
_Pragma("omp simd")
        for (int64_t j = 0; j < v; ++j) g[j] *= k;
        g[t] -= sc;
        store_f32(g, row, v);
      }
    });
  });
}

void ce_fwd_bwd_inplace(torch::Tensor x, torch::Tensor target, int64_t ignore_index, double scale,
                        torch::Tensor losses) {
  gt_check_ce_fwd_bwd_inplace(x, target, losses);
  ce_rows(x, x, x.new_empty(0, torch::kLong), target, ignore_index, scale, losses);
}

void ce_fwd_bwd_rows(torch::Tensor x, torch::Tensor src, torch::Tensor rows, torch::Tensor target,
                     int64_t ignore_index, double scale, torch::Tensor losses) {
  gt_check_ce_fwd_bwd_rows(x, src, rows, target, losses);
  ce_rows(x, src, rows, target, ignore_index, scale, losses);
}
