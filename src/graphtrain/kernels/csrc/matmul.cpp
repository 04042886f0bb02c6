// A binding of oneDNN's matmul (kernels/gemm.py). Why C++: libtorch_cpu exports the function, but torch ships no
// Python binding and no header for it.
#include "common.h"
#include "gt_contracts.h"  // generated when the extension is built (kernels/contract.py)
#include <ATen/cpu/vec/vec.h>  // at::vec::transpose_mxn: AVX-512 32 x 32 bf16 tiles (the build defines CPU_CAPABILITY)
#include <exception>
#ifdef _OPENMP
#include <omp.h>
#endif

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

// out = beta * out + a @ b with the rows of a / out split into one block per thread, each block one oneDNN call run
// by that thread alone (kernels/gemm.py `low_plan` chooses it per shape, by measurement). Why: on the 2-core
// AMX Xeon, oneDNN's bf16 matmul ran 1024 x 1408 x 512 (a Llama MLP's down projection) no faster on 2 threads than on
// 1; the same GEMM as two single-threaded 512-row halves, one per thread, took 0.69 against 1.29 ms.
// Raw OpenMP, not at::parallel_for: each thread must set its own team size to 1 before it calls oneDNN, which sizes
// its primitive (and its own parallel region) from omp_get_max_threads(); the setting is the implicit task's and ends
// with the region. Blocks are whole multiples of 32 rows (oneDNN's row blocking).
void onednn_matmul_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, double beta) {
  gt_check_onednn_matmul_rows(a, b, out);
  const int64_t m = a.size(0);
  const int nthr = (int)std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (m + 31) / 32));
#ifdef _OPENMP
  if (nthr > 1 && !omp_in_parallel()) {
    const int64_t blk = ((m + nthr - 1) / nthr + 31) / 32 * 32;
    std::exception_ptr err = nullptr;
#pragma omp parallel num_threads(nthr)
    {
      const int64_t s = (int64_t)omp_get_thread_num() * blk, e = std::min(m, s + blk);
      if (s < e) {
        omp_set_num_threads(1);
        try {
          at::native::mkldnn_matmul(a.narrow(0, s, e - s), b, out.narrow(0, s, e - s), (float)beta, 1.f);
        } catch (...) {
#pragma omp critical(gt_matmul_rows_error)
          if (!err) err = std::current_exception();
        }
      }
    }
    if (err) std::rethrow_exception(err);
    return;
  }
#endif
  at::native::mkldnn_matmul(a, b, out, (float)beta, 1.f);
}

// dst (contiguous) = src, a bf16 matrix stored transposed (stride(0) 1): the copy that lets a GEMM read its A operand
// row-major (kernels/gemm.py, the "transpose" plan). Why C++: oneDNN's bf16 matmul ran the weight gradient dY^T @ X,
// which reads A transposed, 1.7-2.4x slower than the same product with A contiguous (2-core AMX Xeon), and aten's
// transposed copy runs element by element: 0.93 ms for a [1408, 1024] matrix, 22 ms for [16384, 1024], against 0.15
// and 3.6-8 ms in 32 x 32 tiles of at::vec::transpose_mxn (ATen's own AVX-512 transpose, which Inductor's generated
// code calls too; a scalar loop in builds below AVX-512).
// Tile order and prefetch: each strip of 32 source rows (S, the [C, R] row-major matrix src is the transpose of) is
// walked along its columns, and the next tile's 32 source lines and the output lines two tiles ahead are prefetched.
// A source row a power of two bytes long (the LM head's d logits, [1024, 32768]: 64 KiB) puts a tile's 32 lines in
// one cache set, so the hardware prefetchers' lines were evicted before use and every load waited on memory. Before
// and after, median of 15 on the 2-core AMX Xeon (2 threads), a same-layout copy of the matrix beside: [1024, 32768]
// 24.0 -> 9.6 ms (copy 3.7), [2048, 16384] 25.3 -> 7.9 (3.8), [1024, 16384] 3.9 -> 3.0 (1.4), [1024, 2816]
// 0.54 -> 0.50 (0.24), [1024, 1024] 0.15 -> 0.14 (0.07). A prefetch cannot fault; it is issued only for lines inside
// src and dst.
void transpose_bf16(const at::Tensor& src, const at::Tensor& dst) {
  gt_check_transpose_bf16(src, dst);
  const int64_t R = src.size(0), C = src.size(1);
  if (R == 0 || C == 0) return;
  const int64_t ld = C > 1 ? src.stride(1) : R;  // src (r, c) at s[r + c * ld]: row c of a [C, R] matrix S
  const c10::BFloat16* s = src.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* d = dst.data_ptr<c10::BFloat16>();
  const int64_t tr = (R + 31) / 32, tc = (C + 31) / 32;
  constexpr int64_t kWriteAhead = 2;  // tiles
  at::parallel_for(0, tr * tc, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t j = (t / tr) * 32, i = (t % tr) * 32;  // the tile at dst rows i.., columns j..
      const int64_t m = std::min<int64_t>(32, C - j), n = std::min<int64_t>(32, R - i);
      if (i + 32 < R)  // the next tile's source lines: S rows j.. (m of them), from column i + 32
        for (int64_t r = 0; r < m; ++r) __builtin_prefetch(s + (j + r) * ld + i + 32, 0, 3);
      const int64_t iw = i + 32 * kWriteAhead;
      if (iw + 32 <= R)  // the output lines kWriteAhead tiles on: dst rows iw.., columns j..
        for (int64_t r = 0; r < 32; ++r) __builtin_prefetch(d + (iw + r) * C + j, 1, 3);
      // S rows j.. (m of them), columns i.. (n)  ->  dst rows i.. (n), columns j.. (m)
      at::vec::transpose_mxn<c10::BFloat16>(s + j * ld + i, ld, d + i * C + j, C, (int)m, (int)n);
    }
  });
}
