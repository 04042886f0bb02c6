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

// out = dropout(x + bias) + residual over rows of length n (bias [n] or empty, residual like x or empty).
torch::Tensor bias_dropout_add_fwd(torch::Tensor x, torch::Tensor bias, torch::Tensor residual, double p,
                                   int64_t seed) {
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t numel = xc.numel();
  const int64_t n = xc.dim() ? xc.size(-1) : 1;
  const bool has_b = bias.numel() > 0, has_r = residual.numel() > 0;
  auto bc = has_b ? bias.contiguous() : bias;
  auto rc = has_r ? residual.contiguous() : residual;
  const uint32_t thr = gt_threshold(p);
  const float scale = p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f;
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
          keep_block((uint64_t)seed, (uint64_t)o, len, thr, scale, keep);
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
  auto gc = g.contiguous();
  auto out = torch::empty_like(gc);
  const int64_t numel = gc.numel();
  const uint32_t thr = gt_threshold(p);
  const float scale = p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gc.scalar_type(), "dropout_bwd", [&] {
    const scalar_t* gp = gc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, numel, 16384, [&](int64_t begin, int64_t end) {
      float keep[GT_CHUNK], gb[GT_CHUNK], ob[GT_CHUNK];
      for (int64_t i0 = begin; i0 < end; i0 += GT_CHUNK) {
        const int64_t len = std::min(GT_CHUNK, end - i0);
        keep_block((uint64_t)seed, (uint64_t)i0, len, thr, scale, keep);
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
  TORCH_CHECK(!has_b || bc.numel() == n, "gelu_tanh: bias must have the last dim's size");
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

torch::Tensor gelu_tanh_fwd(torch::Tensor x, torch::Tensor bias) { return gelu_tanh(x, bias, x, false); }
torch::Tensor gelu_tanh_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor bias) {
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
  TORCH_CHECK(s.is_contiguous() && s.dim() == 3, "attn_probs_fwd: scores must be contiguous [BH, Sq, Sk]");
  const int64_t BH = s.size(0), sq = s.size(1), sk = s.size(2);
  auto lse = torch::empty({BH, sq}, s.options().dtype(torch::kFloat));
  const uint32_t thr = gt_threshold(p);
  const float dscale = p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f;
  const bool drop = p > 0.0;
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
        if (drop) keep_block((uint64_t)seed, (uint64_t)r * sk, n, thr, dscale * inv, keep.data());
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
void attn_probs_bwd(torch::Tensor s, torch::Tensor dp, torch::Tensor mask, torch::Tensor lse, torch::Tensor delta,
                    int64_t heads, double scale, bool causal, double p, int64_t seed) {
  TORCH_CHECK(s.is_contiguous() && dp.is_contiguous() && lse.is_contiguous() && delta.is_contiguous(),
              "attn_probs_bwd: contiguous inputs expected");
  const int64_t BH = s.size(0), sq = s.size(1), sk = s.size(2);
  const uint32_t thr = gt_threshold(p);
  const float dscale = p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f;
  const bool drop = p > 0.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, s.scalar_type(), "attn_probs_bwd", [&] {
    scalar_t* sp = s.data_ptr<scalar_t>();
    scalar_t* dpp = dp.data_ptr<scalar_t>();
    const float* lp = lse.data_ptr<float>();
    const float* dl = delta.data_ptr<float>();
    const int64_t ms3 = mask.numel() ? mask.stride(3) : 0;
    at::parallel_for(0, BH * sq, std::max<int64_t>(1, 16384 / sk), [&](int64_t r0, int64_t r1) {
      std::vector<float> v(sk), keep(sk), d(sk), out(sk);
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* row = sp + r * sk;
        scalar_t* drow = dpp + r * sk;
        const int64_t n = causal_len(causal, r % sq, sk);
        attn_row_logits(row, mask_row<scalar_t>(mask, r, heads, sq), ms3, n, (float)scale, v.data());
        const float lse_r = lp[r], delta_r = dl[r], fs = (float)scale;
        if (drop) keep_block((uint64_t)seed, (uint64_t)r * sk, n, thr, dscale, keep.data());
        else std::fill(keep.begin(), keep.begin() + n, 1.f);
        const float* df = as_f32(drow, n, d.data());
        _Pragma("omp simd")
        for (int64_t j = 0; j < n; ++j) {
          const float pr = std::isinf(lse_r) ? 0.f : gt_exp(v[j] - lse_r);
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
// copy); outputs are written through their strides too. Dropout draws the keep mask of element (bh * Sq + i) * Sk + j from
// the hash, as attn_probs_fwd/_bwd do, so both paths drop the same entries. Measured on the 2-core Zen 4 against
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

static void attn_heads_check(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(&sgemm_ != nullptr, "attn_heads: this torch build exports no sgemm_");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->stride(3) == 1,
                "attn_heads: q, k, v must be fp32 [B, H, S, D] with unit stride in D");
}

// Writes out [B, H, Sq, Dv] (any strides, unit in Dv); returns lse [B, H, Sq] fp32.
torch::Tensor attn_heads_fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, double scale,
                             bool causal, double p, int64_t seed, int64_t qb) {
  attn_heads_check(q, k, v);
  attn_heads_check(out, out, out);
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2), Dv = v.size(3);
  auto lse = torch::empty({B, H, Sq}, q.options());
  const uint32_t thr = gt_threshold(p);
  const float dscale = p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f;
  const bool drop = p > 0.0;
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
    float* const S = heads_scratch(qb * Sk + Sk);
    float* const keep = S + qb * Sk;
    for (int64_t bh = h0; bh < h1; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float *Q = head_ptr(q, b, h), *K = head_ptr(k, b, h), *V = head_ptr(v, b, h);
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
          if (drop) {
            keep_block((uint64_t)seed, (uint64_t)(bh * Sq + i0 + r) * Sk, n, thr, dscale * inv, keep);
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
void attn_heads_bwd(torch::Tensor dout, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                    torch::Tensor lse, torch::Tensor dq, torch::Tensor dk, torch::Tensor dv, double scale, bool causal,
                    double p, int64_t seed, int64_t qb) {
  attn_heads_check(q, k, v);
  attn_heads_check(dout, out, out);
  attn_heads_check(dq, dk, dv);
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat, "attn_heads_bwd: lse must be contiguous fp32");
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2), Dv = v.size(3);
  const uint32_t thr = gt_threshold(p);
  const float dscale = p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f;
  const bool drop = p > 0.0;
  const float fs = (float)scale;
  at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
    float* const S = heads_scratch(2 * qb * Sk + Sk);
    float* const dP = S + qb * Sk;
    float* const keep = dP + qb * Sk;
    for (int64_t bh = h0; bh < h1; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float *Q = head_ptr(q, b, h), *K = head_ptr(k, b, h), *V = head_ptr(v, b, h);
      const float *O = head_ptr(out, b, h), *dO = head_ptr(dout, b, h);
      const int64_t qs = q.stride(2), ks = k.stride(2), vs = v.stride(2), os = out.stride(2), ds = dout.stride(2);
      float* dQ = const_cast<float*>(head_ptr(dq, b, h));
      float* dK = const_cast<float*>(head_ptr(dk, b, h));
      float* dV = const_cast<float*>(head_ptr(dv, b, h));
      const int64_t dqs = dq.stride(2), dks = dk.stride(2), dvs = dv.stride(2);
      auto zero_rows = [](float* t, int64_t r0, int64_t r1, int64_t ld, int64_t n) {
        for (int64_t r = r0; r < r1; ++r) std::fill(t + r * ld, t + r * ld + n, 0.f);
      };
      const float* L = lse.data_ptr<float>() + bh * Sq;
      const int64_t nblk = (Sq + qb - 1) / qb;
      if (nblk == 0) { zero_rows(dK, 0, Sk, dks, D); zero_rows(dV, 0, Sk, dvs, Dv); }
      // Last block first: under causal attention it sees every key, so its GEMMs (beta 0) initialise all of dK
      // and dV; the others accumulate into the keys they see.
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
          float *s = S + r * Sk, *dp = dP + r * Sk;
          const int64_t n = causal ? std::min(kend, i0 + r + 1) : kend;
          const float lr = L[i0 + r];
          if (drop) keep_block((uint64_t)seed, (uint64_t)(bh * Sq + i0 + r) * Sk, n, thr, dscale, keep);
          else std::fill(keep, keep + n, 1.f);
          _Pragma("omp simd")
          for (int64_t j = 0; j < n; ++j) {
            const float pr = gt_exp(s[j] - lr);
            dp[j] = pr * (dp[j] * keep[j] - delta) * fs;  // dS * scale, for dQ and dK
            s[j] = pr * keep[j];                           // the dropped probabilities, for dV
          }
          std::fill(s + n, s + kend, 0.f);
          std::fill(dp + n, dp + kend, 0.f);
        }
        const float beta = bi == nblk - 1 ? 0.f : 1.f;
        rm_gemm(true, false, kend, Dv, rows, 1.f, S, Sk, dO + i0 * ds, ds, beta, dV, dvs);
        rm_gemm(false, false, rows, D, kend, 1.f, dP, Sk, K, ks, 0.f, dQ + i0 * dqs, dqs);
        rm_gemm(true, false, kend, D, rows, 1.f, dP, Sk, Q + i0 * qs, qs, beta, dK, dks);
        if (beta == 0.f && kend < Sk) {  // keys no query sees (causal with Sq < Sk): no gradient
          zero_rows(dV, kend, Sk, dvs, Dv);
          zero_rows(dK, kend, Sk, dks, D);
        }
      }
    }
  });
}

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
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "ce_fwd_bwd_inplace: x must be a contiguous [n, v] tensor");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous() && target.numel() == x.size(0),
              "ce_fwd_bwd_inplace: target must be int64 [n]");
  TORCH_CHECK(losses.scalar_type() == at::kFloat && losses.is_contiguous() && losses.numel() == x.size(0),
              "ce_fwd_bwd_inplace: losses must be fp32 [n]");
  const int64_t n = x.size(0), v = x.size(1);
  const bool gather = rows.numel() > 0;
  TORCH_CHECK(!gather || (src.dim() == 2 && src.is_contiguous() && src.size(1) == v && src.scalar_type() ==
              x.scalar_type() && rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == n),
              "ce_fwd_bwd_rows: src must be a contiguous [m, v] tensor of x's dtype, rows int64 [n]");
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
  ce_rows(x, x, x.new_empty(0, torch::kLong), target, ignore_index, scale, losses);
}

void ce_fwd_bwd_rows(torch::Tensor x, torch::Tensor src, torch::Tensor rows, torch::Tensor target,
                     int64_t ignore_index, double scale, torch::Tensor losses) {
  TORCH_CHECK(rows.numel() == x.size(0), "ce_fwd_bwd_rows: one source row per row of x");
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
  TORCH_CHECK(out.is_contiguous(), "onednn_matmul: out must be contiguous");
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

MODULE_NAME = "graphtrain_cpu_kernels_v15"
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
    with _lock:
        if level not in _modules and level not in _failed:
            try:
                from torch.utils.cpp_extension import load_inline
                name = f"{MODULE_NAME}_{level}"
                build_dir = build_directory(name)
                with _build_lock(build_dir):
                    _modules[level] = load_inline(
                        name=name, cpp_sources=[_CPP], functions=_DECLS,
                        extra_cflags=["-O3", *_ISA_FLAGS[level], "-fopenmp", *_FP_FLAGS], extra_ldflags=["-fopenmp"],
                        build_directory=build_dir, verbose=False)
            except Exception as e:  # no compiler / headers: correctness first, reference path
                _failed[level] = f"{type(e).__name__}: {e}"
                warnings.warn(f"graphtrain: CPU kernels ({level}) could not be built, using reference ops: "
                              f"{_failed[level][:300]}")
    return _modules.get(level)


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
    return f"c++ ({level} build)" if level in _modules else None
