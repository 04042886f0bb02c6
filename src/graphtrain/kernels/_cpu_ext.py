"""Hand-written CPU kernels (C++ via torch.utils.cpp_extension.load_inline), built once and cached.

Why C++ here: on the 2-core EPYC aten's Bernoulli sampler costs ~5 ns/element (2.6 ms for
a [1024, 512] fp32 mask, 50x an elementwise add), so dropout dominates every fused op that contains
it. These kernels draw the keep-mask from a counter-based hash of (seed, element index): it is
reproducible, so backward regenerates the mask instead of saving it (0 bytes of saved mask), and
it vectorizes (on AVX-512 with native 64-bit multiplies). Keep decision: hash32(seed, i) >= p * 2^32, i.e.
P(keep) = 1 - p up to 2^-32; kept values are scaled by 1/(1-p).

Portability: the source is plain C++ (no intrinsics); gcc vectorizes it for the ISA level it is
built for. One build per level, named after it (`_ISA_FLAGS`): AVX-512 (F/BW/VL/DQ), AVX2 + FMA, or
the compiler's baseline. Never ``-march=native``: torch's extension cache keys builds by source and
flags, not by CPU, so a native build cached on an AVX-512 machine would die of SIGILL on an AVX2 one
that shares the cache. On AVX2 the hash's 64-bit multiplies are emulated from 32-bit ones (there is
no vpmullq), which changes speed, never bits: tests compare every build with the reference bit for bit.

`load()` returns the module or None (no compiler, build failure): callers then run the reference.
The build takes ~40 s the first time and is cached under TORCH_EXTENSIONS_DIR afterwards, in a folder per
torch install (`build_directory`): torch keys its folder by the extension's name only, so two virtual
environments sharing ~/.cache rebuilt it in turn, each first step paying ~30 s (seen between a checkout and
CI's fresh clone). torch's build lock is a plain file that a killed build leaves behind, and every later
process then waits on it forever without a word; builds here hold a kernel lock (`flock`, released when its
holder dies) and clear a lock file no live builder can own (`_stale_lock_cleared`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import warnings
from typing import Iterator

from graphtrain.kernels import capability
from graphtrain.kernels._cpu_alloc import ALLOCATOR_CPP
from graphtrain.kernels._cpu_attention import ATTENTION_CPP
from graphtrain.kernels.contract import Contract, Rule, cpp_checks, register_contract

# The contracts of the entry points below (contract.py): each entry point's first statement is its check, and the
# kernel files' gates evaluate the same rules before choosing it. An absent optional tensor is an empty one.
_ROWS = Rule("x.dim() > 0 && x.size(-1) > 0 && cpu(x) && floating(x)",
             "x must be a floating-point CPU tensor with a non-empty last dim (the rows the kernel walks)")
_BIAS = Rule("bias.numel() == 0 || (bias.numel() == x.size(-1) && same_dtype(bias, x) && cpu(bias))",
             "bias must be empty or hold the last dim's size, in x's dtype")
BIAS_DROPOUT_ADD_FWD = register_contract(Contract("bias_dropout_add_fwd", ("x", "bias", "residual"), rules=(
    _ROWS, _BIAS,
    Rule("residual.numel() == 0 || (same_shape(residual, x) && same_dtype(residual, x) && cpu(residual))",
         "residual must be empty or shaped and typed as x"),
)))
DROPOUT_BWD = register_contract(Contract("dropout_bwd", ("g",), rules=(
    Rule("cpu(g) && floating(g)", "g must be a floating-point CPU tensor"),
)))
GELU_TANH_FWD = register_contract(Contract("gelu_tanh_fwd", ("x", "bias"), rules=(_ROWS, _BIAS)))
GELU_TANH_BWD = register_contract(Contract("gelu_tanh_bwd", ("dy", "x", "bias"), rules=(
    _ROWS, _BIAS, Rule("same_shape(dy, x) && same_dtype(dy, x) && cpu(dy)", "dy must be shaped and typed as x"),
)))
_CE = (
    Rule("x.dim() == 2 && x.is_contiguous() && cpu(x) && floating(x)",
         "x must be a contiguous floating-point CPU [n, v] tensor"),
    Rule("int64(target) && target.is_contiguous() && target.numel() == x.size(0)", "target must be int64 [n]"),
    Rule("f32(losses) && losses.is_contiguous() && losses.numel() == x.size(0)", "losses must be fp32 [n]"),
)
CE_INPLACE = register_contract(Contract("ce_fwd_bwd_inplace", ("x", "target", "losses"), rules=_CE))
CE_ROWS = register_contract(Contract("ce_fwd_bwd_rows", ("x", "src", "rows", "target", "losses"), rules=(
    *_CE,
    Rule("src.dim() == 2 && src.is_contiguous() && src.size(1) == x.size(1) && same_dtype(src, x) && cpu(src)",
         "src must be a contiguous [m, v] tensor of x's dtype"),
    Rule("int64(rows) && rows.is_contiguous() && rows.numel() == x.size(0)", "rows must be int64 [n]"),
)))
ONEDNN_MATMUL = register_contract(Contract("onednn_matmul", ("a", "b", "out"), rules=(
    Rule("(a.dim() == 2 || a.dim() == 3) && b.dim() == a.dim() && out.dim() == a.dim()",
         "a, b and out must all be 2-D or all 3-D"),
    Rule("a.size(-1) == b.size(-2) && out.size(-2) == a.size(-2) && out.size(-1) == b.size(-1) && "
         "(a.dim() == 2 || (b.size(0) == a.size(0) && out.size(0) == a.size(0)))",
         "shapes must be a [.., M, K] @ b [.., K, N] -> out [.., M, N]"),
    Rule("out.is_contiguous() && same_dtype(a, b) && same_dtype(a, out) && floating(a) && cpu(a) && cpu(b) && "
         "cpu(out)", "a, b and a contiguous out must be CPU tensors of one floating dtype"),
)))

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

static inline uint32_t gt_hash(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z = z ^ (z >> 31);
  return (uint32_t)(z >> 32);
}

// exp(x) for x <= 0 ... 88: 2^(x log2 e) with round-to-nearest range reduction and a degree-7
// Taylor polynomial of 2^f on [-0.5, 0.5] (rel. error < 1e-7); branch-free so gcc vectorizes it
// (std::exp does not vectorize without -ffast-math, which would break the -inf checks).
static inline float gt_exp(float x) {
  const float xc = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float t = xc * 1.44269504088896341f;
  const float fi = (t + 12582912.f) - 12582912.f;
  const float f = (t - fi) * 0.69314718055994531f;
  float p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720 + f * (1.f / 5040)))))));
  int32_t bits = ((int32_t)fi + 127) << 23;
  float s; std::memcpy(&s, &bits, 4);
  return x < -87.f ? 0.f : p * s;
}

static inline uint32_t gt_threshold(double p) {
  double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
}

// Dropout with probability p as every kernel here applies it: the hash threshold below which an element drops, the
// scale of the kept ones (1 / (1 - p); 0 when p = 1 drops everything) and whether anything drops at all.
struct DropSpec {
  uint32_t thr;
  float scale;
  bool on;
  explicit DropSpec(double p) : thr(gt_threshold(p)), scale(p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f), on(p > 0.0) {}
};

// Keep-factors for elements base..base+n-1: scale where hash32(seed, i) >= thr, else 0. A loop of its
// own so that gcc vectorizes the 64-bit hash (the fused loops below did not, at 2 ns/element).
static inline void keep_block(uint64_t seed, uint64_t base, int64_t n, uint32_t thr, float scale, float* keep) {
_Pragma("omp simd")
  for (int64_t j = 0; j < n; ++j) keep[j] = gt_hash(seed, base + (uint64_t)j) >= thr ? scale : 0.f;
}

// Element loads/stores through fp32 scratch, written so that gcc vectorizes them. bf16 rounds to
// nearest even with NaN kept quiet, bit for bit what c10::BFloat16's conversion does.
template <typename T> static inline const float* as_f32(const T* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
_Pragma("omp simd")
    for (int64_t j = 0; j < n; ++j) { uint32_t b = (uint32_t)s[j] << 16; float f; std::memcpy(&f, &b, 4); buf[j] = f; }
    return buf;
  } else {
    for (int64_t j = 0; j < n; ++j) buf[j] = (float)src[j];
    return buf;
  }
}
template <typename T> static inline void store_f32(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (src != dst) std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
_Pragma("omp simd")
    for (int64_t j = 0; j < n; ++j) {
      uint32_t b; std::memcpy(&b, &src[j], 4);
      d[j] = src[j] != src[j] ? (uint16_t)0x7FC0 : (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = (T)src[j];
  }
}

constexpr int64_t GT_CHUNK = 1024;
""" + cpp_checks() + r"""

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

""" + ATTENTION_CPP + r"""
// Softmax cross-entropy over the rows of x [n, v] (contiguous), in place: losses[r] = logsumexp(x[r]) - x[r, t[r]]
// (0 where t[r] == ignore_index), and x[r] becomes (softmax(x[r]) - onehot(t[r])) * scale (all 0 where ignored),
// i.e. the loss and its gradient in one call. A row stays in cache across its passes (max, sum of exp, write),
// where the torch sequence (logsumexp, gather, sub, exp, scatter, mul, cast) streams the chunk through memory
// about eight times. fp32 math for fp32/bf16/fp16 inputs.
// src_rows: row r reads src[rows[r]] (src [m, v] contiguous, same dtype) and writes x[r] (not read): the rows of a
// head's returned logits go straight from those logits to the gradient, without a copy into x first. Empty rows:
// x is its own source.
static void ce_rows(torch::Tensor x, torch::Tensor src, torch::Tensor rows, torch::Tensor target,
                    int64_t ignore_index, double scale, torch::Tensor losses) {
  // the callers below checked their contracts
  const int64_t n = x.size(0), v = x.size(1);
  const bool gather = rows.numel() > 0;
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
        scalar_t* row = xp + r * v;
        const int64_t t = tp[r];
        if (t == ignore_index) {
          lp[r] = 0.f;
          std::memset((void*)row, 0, v * sizeof(scalar_t));
          continue;
        }
        const float* f = as_f32(sp + (gather ? rp[r] : r) * v, v, buf.data());
        float m = -INFINITY;
_Pragma("omp simd reduction(max:m)")
        for (int64_t j = 0; j < v; ++j) m = f[j] > m ? f[j] : m;
        float s = 0.f;
_Pragma("omp simd reduction(+:s)")
        for (int64_t j = 0; j < v; ++j) s += gt_exp(f[j] - m);
        const float lse = m + std::log(s);
        lp[r] = lse - f[t];
        // the gradient over the source row: in place (x is the source), into x's row (fp32) or the fp32 scratch
        float* g = gather && std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(row) : const_cast<float*>(f);
_Pragma("omp simd")
        for (int64_t j = 0; j < v; ++j) g[j] = gt_exp(f[j] - lse) * sc;
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

// oneDNN's matmul as aten calls it for bf16/fp16 (declared in ATen/native/mkldnn/Matmul.h, exported by
// libtorch_cpu, header not shipped in the wheel). aten's fp32 mm goes to MKL instead, see gemm.py.
namespace at { namespace native {
TORCH_API void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result,
                             float beta, float alpha);
}}

// out = beta * out + a @ b; a, b, out 2-D (or 3-D: batched), each contiguous or with its last two dims
// transposed (others are copied by aten first); out must be contiguous.
void onednn_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, double beta) {
  gt_check_onednn_matmul(a, b, out);
  at::native::mkldnn_matmul(a, b, out, (float)beta, 1.f);
}
""" + ALLOCATOR_CPP  # the allocator's source (_cpu_alloc.py) starts with its own blank line

_DECLS = ["bias_dropout_add_fwd", "dropout_bwd", "dropout_mask", "gelu_tanh_fwd", "gelu_tanh_bwd", "attn_probs_fwd",
          "attn_probs_bwd", "attn_heads_available", "attn_heads_fwd", "attn_heads_bwd", "onednn_matmul", "ce_fwd_bwd_inplace", "ce_fwd_bwd_rows", "block_allocator",
          "block_cache_drain", "block_cache_stats", "block_cache_prime", "block_cache_prime_stop",
          "block_cache_settle", "block_cache_record"]

# Compiler flags per ISA level (explicit -m flags rather than -march=x86-64-v3/v4 so older compilers work).
_ISA_FLAGS: dict[str, list[str]] = {
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mavx512cd", "-mprefer-vector-width=512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2"],
    "baseline": [],
}

# No floating-point traps: we never read FP exception flags, and with -ftrapping-math (gcc's default) gcc keeps a
# loop with a float compare-and-select (the exp's range clamp, tanh's small-argument branch) scalar on AVX2 ("control
# flow in loop"; AVX-512 masks it). Bits are unchanged: nothing is reassociated or contracted differently. Measured
# on GELU's tanh, one thread: 11.1 ms scalar, 1.8 ms vectorized (AVX2 build, 2M elements).
_FP_FLAGS = ["-fno-trapping-math"]

MODULE_NAME = "graphtrain_cpu_kernels_v19"
"""The extension's name (and build folder's) before its ISA level: a new version number for each change of _CPP."""

_lock = threading.Lock()
_modules: dict[str, object] = {}
_failed: dict[str, str] = {}


def isa_level() -> str:
    """The build level for this CPU (after any capability.simulate): avx512, avx2 or baseline."""
    c = capability.cpu()
    if c.arch not in ("x86_64", "AMD64"):
        return "baseline"
    return "avx512" if c.avx512 else ("avx2" if c.avx2 else "baseline")


def load(level: str | None = None):
    """The compiled module for `level` (default: this CPU's), or None if it cannot be built here (then the
    reference runs)."""
    if os.environ.get("GRAPHTRAIN_NO_CPP") == "1":
        return None
    level = level or isa_level()
    if level in _modules or level in _failed:
        return _modules.get(level)
    if level not in _ISA_FLAGS:
        raise ValueError(f"unknown ISA level {level!r}; known: {', '.join(_ISA_FLAGS)}")
    checks = sanitizers()  # a misspelt GRAPHTRAIN_SANITIZE raises here, not as a failed build
    with _lock:
        if level not in _modules and level not in _failed:
            try:
                from torch.utils.cpp_extension import load_inline
                name = f"{MODULE_NAME}_{level}" + "".join(f"_{c}" for c in checks)
                build_dir = build_directory(name)
                san = [f"-fsanitize={','.join(checks)}", "-fno-omit-frame-pointer", "-g"] if checks else []
                with _build_lock(build_dir):
                    _modules[level] = load_inline(
                        name=name, cpp_sources=[_CPP], functions=_DECLS,
                        extra_cflags=["-O3", *_ISA_FLAGS[level], "-fopenmp", *_FP_FLAGS, *san],
                        extra_ldflags=["-fopenmp", *san], build_directory=build_dir, verbose=False)
            except Exception as e:  # no compiler / headers: correctness first, reference path
                if checks:  # a sanitizer run on the references would check nothing: say why it cannot run
                    raise RuntimeError(f"graphtrain: the {'+'.join(checks)}-sanitized CPU kernels ({level}) could not "
                                       f"be built or loaded (GRAPHTRAIN_SANITIZE): {type(e).__name__}: {e}") from e
                _failed[level] = f"{type(e).__name__}: {e}"
                warnings.warn(f"graphtrain: CPU kernels ({level}) could not be built, using reference ops: "
                              f"{_failed[level][:300]}")
    return _modules.get(level)


SANITIZERS = ("address", "undefined")
"""What GRAPHTRAIN_SANITIZE may name (comma-separated): gcc's AddressSanitizer and UndefinedBehaviorSanitizer."""


def sanitizers() -> tuple[str, ...]:
    """The sanitizers GRAPHTRAIN_SANITIZE asks the C++ kernels to be built with (debugging and the slow suite's
    sanitizer job, tests/test_sanitizers.py): each such build has a name and folder of its own, so it never replaces
    the normal build. An ASan build loads only into a process that starts with libasan first
    (LD_PRELOAD=$(gcc -print-file-name=libasan.so), ASAN_OPTIONS=detect_leaks=0: Python frees little at exit)."""
    raw = os.environ.get("GRAPHTRAIN_SANITIZE", "")
    names = tuple(sorted({s.strip() for s in raw.split(",") if s.strip()}))
    unknown = [s for s in names if s not in SANITIZERS]
    if unknown:
        raise ValueError(f"GRAPHTRAIN_SANITIZE={raw!r}: unknown sanitizer {', '.join(unknown)}; use a comma-separated "
                         f"list of {', '.join(SANITIZERS)} (or leave it unset)")
    return names


def build_directory(name: str) -> str:
    """<TORCH_EXTENSIONS_DIR or torch's default root>/<name>-<torch version and install path digest>."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = hashlib.sha256(f"{torch.__version__}|{os.path.dirname(os.path.abspath(torch.__file__))}".encode()).hexdigest()
    path = os.path.join(root, f"{name}-{tag[:12]}")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _build_lock(build_dir: str) -> Iterator[None]:
    """Serialises graphtrain's builds of one folder with flock (the kernel drops it if the holder dies), then
    removes torch's `lock` file if one is left: every builder of this folder holds the flock first, so while we
    hold it no live process can own that file."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        yield
        return
    fd = os.open(os.path.join(build_dir, "graphtrain.flock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _stale_lock_cleared(build_dir)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def _stale_lock_cleared(build_dir: str) -> None:
    stale = os.path.join(build_dir, "lock")
    try:
        os.remove(stale)
    except FileNotFoundError:
        return
    warnings.warn(f"graphtrain: removed a build lock left by a killed build of its CPU kernels ({stale}); "
                  "rebuilding")


def build_error(level: str | None = None) -> str | None:
    """Why `load(level)` returned None (None if it did not fail, or was not tried)."""
    if os.environ.get("GRAPHTRAIN_NO_CPP") == "1":
        return "GRAPHTRAIN_NO_CPP=1"
    return _failed.get(level or isa_level())


def loaded_variant() -> str | None:
    """A label of the build the current CPU uses, if it is loaded (for the report)."""
    level = isa_level()
    san = "".join(f", {c} sanitizer" for c in sanitizers())
    return f"c++ ({level} build{san})" if level in _modules else None
