// What graphtrain's CPU kernels share (kernels/_cpu_ext.py builds every file of this folder into one extension,
// one build per ISA level): the counter-based dropout hash, an exp that vectorises, and loads/stores through fp32
// scratch.
// Why C++ here: on the 2-core EPYC aten's Bernoulli sampler costs ~5 ns/element, so dropout dominated every fused op
// that contains it. The keep-mask here is a hash of (seed, element index): reproducible, so backward regenerates it
// instead of saving it, and it vectorises. Plain C++, no intrinsics: gcc vectorises it for the level it is built for.
#pragma once
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
