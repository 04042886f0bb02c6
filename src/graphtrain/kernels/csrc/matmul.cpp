// A binding of oneDNN's matmul (kernels/gemm.py). Why C++: libtorch_cpu exports the function, but torch ships no
// Python binding and no header for it.
#include "common.h"
#include "gt_contracts.h"  // generated when the extension is built (kernels/contract.py)

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
