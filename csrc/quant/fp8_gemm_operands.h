// Argument checks shared by the FP8 W8A8 GEMM ops (fp8_gemm_cublaslt.cpp, fp8_gemm_cutlass.cpp):
// operands as the GEMM libraries read them, with errors that name the op and the argument.
#pragma once

#include <cstdint>

#include <torch/all.h>

namespace omni::quant {

// Pointer alignment the FP8 GEMMs' TMA loads and vector epilogues need (bytes).
constexpr int64_t kFp8GemmAlignBytes = 16;

// `t` as the GEMMs read it: contiguous and 16-byte aligned (a copy if it is not, e.g. a view
// with an odd storage offset, which traced graphs may hand over).
inline torch::Tensor dense_aligned(const torch::Tensor& t) {
  const bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % kFp8GemmAlignBytes == 0;
  return t.is_contiguous() && aligned ? t : t.clone(at::MemoryFormat::Contiguous);
}

// An FP8 operand [rows, cols] on `like`'s device, dense and aligned.
inline torch::Tensor checked_fp8_operand(const char* op, const torch::Tensor& t, const char* name,
                                         int64_t rows, int64_t cols, const torch::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == at::ScalarType::Float8_e4m3fn, op, ": ", name,
              " must be float8_e4m3fn; got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name,
              " must be [", rows, ", ", cols, "]; got ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(),
              ", the activation on ", like.device());
  return dense_aligned(t);
}

// A vector of `size` values of `dtype` (any shape holding them) on `like`'s device.
inline torch::Tensor checked_gemm_vector(const char* op, const torch::Tensor& t, const char* name,
                                         at::ScalarType dtype, int64_t size,
                                         const torch::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == dtype && t.numel() == size, op, ": ", name, " must be a ", dtype,
              " with ", size, " values; got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(),
              ", the activation on ", like.device());
  return dense_aligned(t);
}

}  // namespace omni::quant
