// The helpers the kernels' contracts use (kernels/contract.py): the same names the rules use in Python
// (contract.py _HELPERS_PY). The generated checks (gt_contracts.h, written by contract.py cpp_checks()) include this.
#pragma once
#include <torch/extension.h>
constexpr int64_t GT_INT32_MAX = 2147483647;
static inline bool f32(const torch::Tensor& t) { return t.scalar_type() == at::kFloat; }
static inline bool floating(const torch::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf || s == at::kDouble;
}
static inline bool same_dtype(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type();
}
static inline bool same_shape(const torch::Tensor& a, const torch::Tensor& b) { return a.sizes() == b.sizes(); }
static inline bool bf16(const torch::Tensor& t) { return t.scalar_type() == at::kBFloat16; }
static inline bool int64(const torch::Tensor& t) { return t.scalar_type() == at::kLong; }
static inline bool cpu(const torch::Tensor& t) { return t.device().is_cpu(); }
