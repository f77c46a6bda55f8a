// Host side of the per-token quantization ops (plain/norm-fused, and GELU-fused): argument
// checks and launch. Rows without a norm or modulation (plain or GELU-fused) that fit in 48 KB
// go to the shared-memory-staged kernel (quant_staged_kernel.cuh); the others to the register
// kernel (quant_kernel.cuh).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../ops.h"
#include "quant_params.h"

namespace {

using omni::quant::kMaxRowElements;
using omni::quant::kMaxThreads;
using omni::quant::kMaxVectorsPerThread;
using omni::quant::kVectorElements;

bool is_aligned(const torch::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// A [numel]-element vector or [groups, K] table of x's dtype or float32, on x's device.
const void* checked_operand(const std::optional<torch::Tensor>& operand, const char* name,
                            const torch::Tensor& x, int64_t cols, bool table, bool* is_fp32) {
  *is_fp32 = false;
  if (!operand.has_value()) return nullptr;
  const torch::Tensor& t = *operand;
  TORCH_CHECK(t.is_cuda() && t.device() == x.device(), "quantize_per_token: ", name,
              " must be on ", x.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type() || t.scalar_type() == torch::kFloat32,
              "quantize_per_token: ", name, " must be ", x.scalar_type(), " or float32; got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && is_aligned(t), "quantize_per_token: ", name,
              " must be contiguous and 16-byte aligned");
  if (table) {
    TORCH_CHECK(t.dim() == 2 && t.size(1) == cols && t.size(0) > 0 && x.size(0) % t.size(0) == 0,
                "quantize_per_token: ", name, " must be [G, ", cols, "] with G dividing ",
                x.size(0), "; got ", t.sizes());
  } else {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == cols, "quantize_per_token: ", name,
                " must be 1-D with ", cols, " elements; got ", t.sizes());
  }
  *is_fp32 = t.scalar_type() == torch::kFloat32;
  return t.data_ptr();
}

// The 16-byte vectors each thread of the row's block owns when the caller leaves it to us: the
// fewest (1, 2, 4, 8) that keep the block at kMaxThreads or fewer threads.
int auto_vectors_per_thread(int row_vectors) {
  int vpt = 1;
  while (vpt < kMaxVectorsPerThread && (row_vectors + vpt - 1) / vpt > kMaxThreads) vpt *= 2;
  return vpt;
}

// (vectors a thread, threads a block) for a row of `row_vectors` vectors: auto_vectors_per_thread's
// choice and the warps that cover the row with it.
std::pair<int, int> launch_geometry(int row_vectors) {
  const int vpt = auto_vectors_per_thread(row_vectors);
  const int needed = (row_vectors + vpt - 1) / vpt;
  const int threads =
      std::max(OMNI_WARP_SIZE, (needed + OMNI_WARP_SIZE - 1) / OMNI_WARP_SIZE * OMNI_WARP_SIZE);
  return {vpt, threads};
}

// Threads a block for the staged kernel: ~4 vectors a thread (a row's copies in flight without a
// long per-thread loop), whole warps, at most kStagedMaxThreads. Small blocks let many rows share
// an SM: the memory-level parallelism that streaming a row needs.
int staged_threads(int row_vectors) {
  const int wanted = (row_vectors + 3) / 4;
  const int warps = (wanted + OMNI_WARP_SIZE - 1) / OMNI_WARP_SIZE;
  return std::min(omni::quant::kStagedMaxThreads, std::max(1, warps) * OMNI_WARP_SIZE);
}

// Launches the staged kernel for x's dtype (fp16 or bf16), `gelu` selecting its GELU instantiation.
void launch_staged(at::ScalarType dtype, const omni::quant::Params& params, int64_t rows,
                   omni::quant::OutKind out_kind, bool gelu, cudaStream_t stream) {
  const int threads = staged_threads(params.row_vectors);
  if (dtype == torch::kBFloat16) {
    omni::quant::launch_quantize_staged<__nv_bfloat16>(params, rows, out_kind, gelu, threads,
                                                       stream);
  } else {
    omni::quant::launch_quantize_staged<__half>(params, rows, out_kind, gelu, threads, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether a row of `cols` 16-bit values fits the staged kernel's shared memory.
bool fits_staged(int64_t cols) {
  return cols * 2 <= omni::quant::kStagedMaxRowBytes;
}

// A [rows, K] half-precision operand the kernel reads with 16-byte vectors.
void check_rows(const torch::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D [M, K]; got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1 && t.stride(0) % kVectorElements == 0 && is_aligned(t), op, ": ",
              name, " rows must be contiguous and 16-byte aligned (stride(0) a multiple of ",
              kVectorElements, "); got strides ", t.strides());
  TORCH_CHECK(t.size(1) % kVectorElements == 0, op, ": ", name, " columns must be a multiple of ",
              kVectorElements, "; got ", t.size(1));
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> quantize_per_token(
    const torch::Tensor& x, const std::optional<torch::Tensor>& norm_weight,
    const std::optional<torch::Tensor>& norm_bias, const std::optional<torch::Tensor>& mod_scale,
    const std::optional<torch::Tensor>& mod_shift, int64_t norm, double eps, double clamp,
    at::ScalarType out_dtype) {
  TORCH_CHECK(x.is_cuda(), "quantize_per_token: x must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 2, "quantize_per_token: x must be 2-D [M, K]; got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kHalf || dtype == torch::kBFloat16,
              "quantize_per_token: x must be float16 or bfloat16; got ", dtype);
  TORCH_CHECK(out_dtype == at::ScalarType::Float8_e4m3fn || out_dtype == at::ScalarType::Char,
              "quantize_per_token: out_dtype must be float8_e4m3fn or int8; got ", out_dtype);
  TORCH_CHECK(norm >= 0 && norm <= 2, "quantize_per_token: norm must be 0 (none), 1 (RMS) or 2 "
              "(LayerNorm); got ", norm);
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(cols % kVectorElements == 0 && cols <= kMaxRowElements,
              "quantize_per_token: K must be a multiple of ", kVectorElements, " and at most ",
              kMaxRowElements, "; got ", cols);
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) % kVectorElements == 0 && is_aligned(x),
              "quantize_per_token: x rows must be contiguous and 16-byte aligned (stride(0) a "
              "multiple of ", kVectorElements, "); got strides ", x.strides());

  omni::quant::Params params{};
  params.norm_weight =
      checked_operand(norm_weight, "norm_weight", x, cols, false, &params.norm_weight_fp32);
  params.norm_bias = checked_operand(norm_bias, "norm_bias", x, cols, false, &params.norm_bias_fp32);
  params.mod_scale = checked_operand(mod_scale, "mod_scale", x, cols, true, &params.mod_scale_fp32);
  params.mod_shift = checked_operand(mod_shift, "mod_shift", x, cols, true, &params.mod_shift_fp32);
  int64_t groups = 1;
  if (mod_scale.has_value()) groups = mod_scale->size(0);
  if (mod_shift.has_value()) {
    TORCH_CHECK(!mod_scale.has_value() || mod_shift->size(0) == groups,
                "quantize_per_token: mod_scale and mod_shift must have the same rows");
    groups = mod_shift->size(0);
  }

  auto q = torch::empty({rows, cols}, x.options().dtype(out_dtype));
  auto scale = torch::empty({rows, 1}, x.options().dtype(torch::kFloat32));
  if (rows == 0) return {q, scale};
  TORCH_CHECK(cols > 0, "quantize_per_token: K must be positive");

  params.x = x.data_ptr();
  params.q = q.data_ptr();
  params.scale = scale.data_ptr<float>();
  params.x_row_stride = x.stride(0);
  params.rows_per_group = rows / groups;
  params.row_vectors = static_cast<int>(cols / kVectorElements);
  params.cols = static_cast<int>(cols);
  params.eps = static_cast<float>(eps);
  params.clamp = static_cast<float>(clamp);

  const auto norm_kind = static_cast<omni::quant::NormKind>(norm);
  const auto out_kind = out_dtype == at::ScalarType::Char ? omni::quant::OutKind::kInt8
                                                          : omni::quant::OutKind::kFp8E4m3;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool plain = norm == 0 && params.norm_weight == nullptr && params.norm_bias == nullptr &&
                     params.mod_scale == nullptr && params.mod_shift == nullptr;
  if (plain && fits_staged(cols)) {
    params.gelu_from = params.cols;  // unused without the GELU
    launch_staged(dtype, params, rows, out_kind, false, stream);
    return {q, scale};
  }
  const auto [vpt, threads] = launch_geometry(params.row_vectors);
  if (dtype == torch::kBFloat16) {
    omni::quant::launch_quantize_per_token<__nv_bfloat16>(params, rows, norm_kind, out_kind,
                                                          vpt, threads, stream);
  } else {
    omni::quant::launch_quantize_per_token<__half>(params, rows, norm_kind, out_kind,
                                                   vpt, threads, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale};
}

std::tuple<torch::Tensor, torch::Tensor> quantize_activated(
    const torch::Tensor& x, const std::optional<torch::Tensor>& prefix, int64_t activation_from,
    double clamp, at::ScalarType out_dtype) {
  constexpr const char* kOp = "quantize_activated";
  TORCH_CHECK(x.is_cuda(), kOp, ": x must be a CUDA tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kHalf || dtype == torch::kBFloat16, kOp,
              ": x must be float16 or bfloat16; got ", dtype);
  TORCH_CHECK(out_dtype == at::ScalarType::Float8_e4m3fn || out_dtype == at::ScalarType::Char, kOp,
              ": out_dtype must be float8_e4m3fn or int8; got ", out_dtype);
  check_rows(x, kOp, "x");
  const int64_t rows = x.size(0), k = x.size(1);
  int64_t prefix_cols = 0;
  if (prefix.has_value()) {
    const torch::Tensor& p = *prefix;
    TORCH_CHECK(p.device() == x.device() && p.scalar_type() == dtype, kOp,
                ": prefix must be on ", x.device(), " with x's dtype ", dtype);
    check_rows(p, kOp, "prefix");
    TORCH_CHECK(p.size(0) == rows, kOp, ": prefix must have x's ", rows, " rows; got ", p.size(0));
    TORCH_CHECK(activation_from == 0, kOp,
                ": activation_from must be 0 with a prefix (the GELU applies to all of x); got ",
                activation_from);
    prefix_cols = p.size(1);
  }
  TORCH_CHECK(activation_from >= 0 && activation_from < std::max<int64_t>(k, 1), kOp,
              ": activation_from must be in [0, K=", k, "); got ", activation_from);
  const int64_t width = prefix_cols + k;
  TORCH_CHECK(width <= kMaxRowElements, kOp, ": prefix columns + K must be at most ",
              kMaxRowElements, "; got ", width);

  auto q = torch::empty({rows, width}, x.options().dtype(out_dtype));
  auto scale = torch::empty({rows, 1}, x.options().dtype(torch::kFloat32));
  if (rows == 0 || width == 0) return {q, scale};

  omni::quant::Params params{};
  params.x = x.data_ptr();
  params.q = q.data_ptr();
  params.scale = scale.data_ptr<float>();
  params.prefix = prefix_cols > 0 ? prefix->data_ptr() : nullptr;
  params.prefix_row_stride = prefix_cols > 0 ? prefix->stride(0) : 0;
  params.prefix_vectors = static_cast<int>(prefix_cols / kVectorElements);
  params.gelu_from = static_cast<int>(prefix_cols + activation_from);
  params.x_row_stride = x.stride(0);
  params.rows_per_group = rows;
  params.row_vectors = static_cast<int>(width / kVectorElements);
  params.cols = static_cast<int>(width);
  params.clamp = static_cast<float>(clamp);
  const auto out_kind = out_dtype == at::ScalarType::Char ? omni::quant::OutKind::kInt8
                                                          : omni::quant::OutKind::kFp8E4m3;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (fits_staged(width)) {
    launch_staged(dtype, params, rows, out_kind, true, stream);
    return {q, scale};
  }
  const auto [vpt, threads] = launch_geometry(params.row_vectors);
  if (dtype == torch::kBFloat16) {
    omni::quant::launch_quantize_activated<__nv_bfloat16>(params, rows, out_kind, vpt, threads,
                                                          stream);
  } else {
    omni::quant::launch_quantize_activated<__half>(params, rows, out_kind, vpt, threads, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale};
}

torch::Tensor quantized_linear_fp8(const torch::Tensor& x, const torch::Tensor& w_q,
                                   const torch::Tensor& w_scale,
                                   const std::optional<torch::Tensor>& bias, double clamp,
                                   bool use_fast_accum, c10::string_view gemm) {
  constexpr const char* kOp = "quantized_linear_fp8";
  TORCH_CHECK(gemm == "aten" || gemm == "cublaslt" || gemm == "cublaslt_tuned", kOp,
              ": gemm must be 'aten', 'cublaslt' or 'cublaslt_tuned'; got '", gemm, "'");
  TORCH_CHECK(w_q.dim() == 2 && w_q.scalar_type() == at::ScalarType::Float8_e4m3fn, kOp,
              ": w_q must be a 2-D float8_e4m3fn [N, K]; got a ", w_q.dim(), "-D ",
              w_q.scalar_type());
  const int64_t n = w_q.size(0), k = w_q.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, kOp, ": x must be [M, K=", k, "]; got a ",
              x.dim(), "-D tensor with ", x.size(-1), " columns");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.numel() == n &&
                  w_scale.is_contiguous(),
              kOp, ": w_scale must be a contiguous float32 [N=", n, "]; got ",
              w_scale.scalar_type(), " with ", w_scale.numel(), " values");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->dim() == 1 && bias->size(0) == n,
                kOp, ": bias must be [N=", n, "] in x's dtype ", x.scalar_type(), "; got ",
                bias->scalar_type(), " with ", bias->numel(), " values");
  }
  // quantize_per_token checks x (CUDA, fp16/bf16, 16-byte aligned rows, K a multiple of 8).
  auto quantized = quantize_per_token(x, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                                      0, 0.0, clamp, at::ScalarType::Float8_e4m3fn);
  if (gemm != "aten") {
#if !OMNI_HAS_CUBLASLT_FP8
    TORCH_CHECK(false, kOp, ": gemm '", gemm, "' is omni's cuBLASLt FP8 GEMM, which this build "
                "lacks (it needs CUDA with cuBLAS >= 12.9)");
#else
    return fp8_gemm_cublaslt(std::get<0>(quantized), std::get<1>(quantized), w_q, w_scale, bias,
                             x.scalar_type(), use_fast_accum, gemm == "cublaslt_tuned");
#endif
  }
  // Row-wise scales: scale_a [M, 1] (the activation's), scale_b [1, N] (the weight's); the
  // weight's transpose is the column-major operand cuBLASLt's FP8 GEMM needs.
  return at::_scaled_mm(std::get<0>(quantized), w_q.t(), std::get<1>(quantized),
                        w_scale.view({1, n}), bias, std::nullopt, x.scalar_type(),
                        use_fast_accum);
}
