// Dropout (bias + dropout + add, its backward, the mask itself) and tanh-GELU (forward and backward, with a bias),
// row by row in fp32 chunks. Why C++: see common.h (the hash dropout) and gt_tanh below (a tanh gcc vectorises).
#include "common.h"
#include "gt_contracts.h"  // generated when the extension is built (kernels/contract.py)

// out = dropout(x + bias) + residual over rows of length n (bias [n] or empty, residual like x or empty).
torch::Tensor bias_dropout_add_fwd(torch::Tensor x, torch::Tensor bias, torch::Tensor residual, double p,
                                   int64_t seed) {
  gt_check_bias_dropout_add_fwd(x, bias, residual);
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t numel = xc.numel();
  const int64_t n = xc.dim() ? xc.size(-1) : 1;
  const bool has_b = bias.numel() > 0, has_r = residual.numel() > 0;
  auto bc = has_b ? bias.contiguous() : bias;
  auto rc = has_r ? residual.contiguous() : residual;
  const DropSpec drop(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "bias_dropout_add_fwd", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* bp = has_b ? bc.data_ptr<scalar_t>() : nullptr;
    const scalar_t* rp = has_r ? rc.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t rows = numel / n;
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
      float keep[GT_CHUNK], xb[GT_CHUNK], bb[GT_CHUNK], rb[GT_CHUNK], ob[GT_CHUNK];
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j0 = 0; j0 < n; j0 += GT_CHUNK) {
          const int64_t o = r * n + j0, len = std::min(GT_CHUNK, n - j0);
          keep_block((uint64_t)seed, (uint64_t)o, len, drop.thr, drop.scale, keep);
          const float* xf = as_f32(xp + o, len, xb);
          const float* bf = has_b ? as_f32(bp + j0, len, bb) : nullptr;
          const float* rf = has_r ? as_f32(rp + o, len, rb) : nullptr;
          float* of = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(op + o) : ob;
          if (has_b && has_r) {
_Pragma("omp simd")
            for (int64_t j = 0; j < len; ++j) of[j] = (xf[j] + bf[j]) * keep[j] + rf[j];
          } else if (has_b) {
_Pragma("omp simd")
            for (int64_t j = 0; j < len; ++j) of[j] = (xf[j] + bf[j]) * keep[j];
          } else if (has_r) {
_Pragma("omp simd")
            for (int64_t j = 0; j < len; ++j) of[j] = xf[j] * keep[j] + rf[j];
          } else {
_Pragma("omp simd")
            for (int64_t j = 0; j < len; ++j) of[j] = xf[j] * keep[j];
          }
          store_f32(of, op + o, len);
        }
      }
    });
  });
  return out;
}

// grad of x (and of bias, after a row-sum by the caller): g * mask / (1 - p).
torch::Tensor dropout_bwd(torch::Tensor g, double p, int64_t seed) {
  gt_check_dropout_bwd(g);
  auto gc = g.contiguous();
  auto out = torch::empty_like(gc);
  const int64_t numel = gc.numel();
  const DropSpec drop(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gc.scalar_type(), "dropout_bwd", [&] {
    const scalar_t* gp = gc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, numel, 16384, [&](int64_t begin, int64_t end) {
      float keep[GT_CHUNK], gb[GT_CHUNK], ob[GT_CHUNK];
      for (int64_t i0 = begin; i0 < end; i0 += GT_CHUNK) {
        const int64_t len = std::min(GT_CHUNK, end - i0);
        keep_block((uint64_t)seed, (uint64_t)i0, len, drop.thr, drop.scale, keep);
        const float* gf = as_f32(gp + i0, len, gb);
        float* of = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(op + i0) : ob;
_Pragma("omp simd")
        for (int64_t j = 0; j < len; ++j) of[j] = gf[j] * keep[j];
        store_f32(of, op + i0, len);
      }
    });
  });
  return out;
}

// tanh(u) from the exp above: (1 - e) / (1 + e) with e = exp(-2|u|), the sign put back; for |u| < 1/8 its
// Taylor series to u^7 instead (1 - e cancels there). Rel. error < 3e-7, branch-free: gcc vectorizes it, where
// aten's and Inductor's tanh (Sleef's 1-ulp tanhf) cost 0.8-1.3 ns/element on the 2-core Zen 4.
static inline float gt_tanh(float u) {
  const float a = std::fabs(u);
  const float e = gt_exp(-2.f * a);
  const float big = (1.f - e) / (1.f + e);
  const float a2 = a * a;
  const float small = a * (1.f + a2 * (-1.f / 3 + a2 * (2.f / 15 + a2 * (-17.f / 315))));
  return std::copysign(a < 0.125f ? small : big, u);
}

// GELU, tanh form, of x (+ bias over the last dim): forward y, or with dy the gradient dy * gelu'(x + bias).
static torch::Tensor gelu_tanh(torch::Tensor x, torch::Tensor bias, torch::Tensor dy, bool backward) {
  auto xc = x.contiguous();
  auto gc = backward ? dy.contiguous() : dy;
  auto out = torch::empty_like(xc);
  const int64_t numel = xc.numel();
  const int64_t n = xc.dim() ? xc.size(-1) : 1;
  const bool has_b = bias.numel() > 0;
  auto bc = has_b ? bias.contiguous() : bias;
  constexpr float K = 0.7978845608028654f, C = 0.044715f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "gelu_tanh", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* bp = has_b ? bc.data_ptr<scalar_t>() : nullptr;
    const scalar_t* gp = backward ? gc.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t rows = numel / n;
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
      float xb[GT_CHUNK], zb[GT_CHUNK], bb[GT_CHUNK], gb[GT_CHUNK], tb[GT_CHUNK], ob[GT_CHUNK];
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j0 = 0; j0 < n; j0 += GT_CHUNK) {
          const int64_t o = r * n + j0, len = std::min(GT_CHUNK, n - j0);
          const float* z = as_f32(xp + o, len, xb);
          if (has_b) {
            const float* bf = as_f32(bp + j0, len, bb);
_Pragma("omp simd")
            for (int64_t j = 0; j < len; ++j) zb[j] = z[j] + bf[j];
            z = zb;
          }
_Pragma("omp simd")
          for (int64_t j = 0; j < len; ++j) tb[j] = gt_tanh(K * (z[j] + C * z[j] * z[j] * z[j]));
          float* of = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(op + o) : ob;
          if (backward) {
            const float* gf = as_f32(gp + o, len, gb);
_Pragma("omp simd")
            for (int64_t j = 0; j < len; ++j)
              of[j] = gf[j] * (0.5f * (1.f + tb[j]) +
                               0.5f * z[j] * (1.f - tb[j] * tb[j]) * K * (1.f + 3.f * C * z[j] * z[j]));
          } else {
_Pragma("omp simd")
            for (int64_t j = 0; j < len; ++j) of[j] = 0.5f * z[j] * (1.f + tb[j]);
          }
          store_f32(of, op + o, len);
        }
      }
    });
  });
  return out;
}

torch::Tensor gelu_tanh_fwd(torch::Tensor x, torch::Tensor bias) {
  gt_check_gelu_tanh_fwd(x, bias);
  return gelu_tanh(x, bias, x, false);
}
torch::Tensor gelu_tanh_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor bias) {
  gt_check_gelu_tanh_bwd(dy, x, bias);
  return gelu_tanh(x, bias, dy, true);
}

torch::Tensor dropout_mask(std::vector<int64_t> shape, double p, int64_t seed) {
  auto out = torch::empty(shape, torch::kBool);
  bool* op = out.data_ptr<bool>();
  const uint32_t thr = gt_threshold(p);
  at::parallel_for(0, out.numel(), 16384, [&](int64_t b, int64_t e) {
    float keep[GT_CHUNK];
    for (int64_t i0 = b; i0 < e; i0 += GT_CHUNK) {
      const int64_t len = std::min(GT_CHUNK, e - i0);
      keep_block((uint64_t)seed, (uint64_t)i0, len, thr, 1.f, keep);
      for (int64_t j = 0; j < len; ++j) op[i0 + j] = keep[j] != 0.f;
    }
  });
  return out;
}
