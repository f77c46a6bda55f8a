// Per-token (per-row) quantization to FP8 e4m3 or INT8, optionally fused with the RMSNorm or
// LayerNorm and the adaLN modulation before it, or with the GELU before it (and a prefix read in
// place of a cat): the kernel template and its launchers.
//
// The operation is defined in omni_kernels/quant/reference.py (quantize_per_token_reference, and
// quantize_activated_reference for the GELU instantiation). One thread block per row; each
// thread owns kVecs 16-byte vectors (8 fp16/bf16 values each, vector i of thread t is row
// vector t + i * blockDim.x, so a warp's loads are contiguous). The whole row stays in
// registers between the passes: LayerNorm's mean and variance (two-pass, exact), the absolute
// maximum and the quantized values all come from one read of x. Reductions go through warp
// shuffles and one shared-memory exchange. Everything is float32; q is written as 8-byte
// vectors (8 fp8/int8 values), the row's scale by thread 0.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "../cuda_compat.h"
#include "../vector_io.cuh"
#include "quant_params.h"

namespace omni {
namespace quant {

// The shared helpers of ../vector_io.cuh move one vector of kVectorElements values.
static_assert(kVectorElements == kHalfVectorElements, "vector width differs from vector_io.cuh");

struct SumOp {
  static __device__ __forceinline__ float apply(float a, float b) { return a + b; }
};
struct MaxOp {
  static __device__ __forceinline__ float apply(float a, float b) { return fmaxf(a, b); }
};

// Reduces `value` over the block; every thread gets the result. `shared` holds one float per
// warp; the trailing barrier lets the next call reuse it.
template <typename Op>
__device__ __forceinline__ float block_reduce(float value, float* shared) {
#pragma unroll
  for (int offset = OMNI_WARP_SIZE / 2; offset > 0; offset /= 2) {
    value = Op::apply(value, OMNI_SHFL_XOR(OMNI_FULL_MASK, value, offset, OMNI_WARP_SIZE));
  }
  const int warp = threadIdx.x / OMNI_WARP_SIZE;
  const int lane = threadIdx.x % OMNI_WARP_SIZE;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int num_warps = blockDim.x / OMNI_WARP_SIZE;
  float total = shared[0];
  for (int w = 1; w < num_warps; ++w) total = Op::apply(total, shared[w]);
  __syncthreads();
  return total;
}

template <OutKind kOut>
struct QuantTraits;
template <>
struct QuantTraits<OutKind::kFp8E4m3> {
  static constexpr float kMax = 448.0f;
  // 8 values rounded to nearest even and packed; the conversion saturates past +-448.
  static __device__ __forceinline__ uint2 pack(const float (&v)[kVectorElements]) {
    uint16_t pairs[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i], v[2 * i + 1]), __NV_SATFINITE,
                                          __NV_E4M3);
    }
    return make_uint2(static_cast<uint32_t>(pairs[0]) | (static_cast<uint32_t>(pairs[1]) << 16),
                      static_cast<uint32_t>(pairs[2]) | (static_cast<uint32_t>(pairs[3]) << 16));
  }
};
template <>
struct QuantTraits<OutKind::kInt8> {
  static constexpr float kMax = 127.0f;
  // 8 values in [-127, 127], rounded half to even (__float2int_rn) and packed.
  static __device__ __forceinline__ uint2 pack(const float (&v)[kVectorElements]) {
    uint32_t words[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < kVectorElements; ++i) {
      const uint32_t byte = static_cast<uint8_t>(static_cast<int8_t>(__float2int_rn(v[i])));
      words[i / 4] |= byte << (8 * (i % 4));
    }
    return make_uint2(words[0], words[1]);
  }
};

// 2^x with the hardware approximation (MUFU.EX2), subnormal results flushed to zero: the
// non-ftz exp2f adds range fix-ups around it, and a GELU only needs exp2 of its (normal)
// argument in 1 + exp2(.).
__device__ __forceinline__ float exp2_ftz(float x) {
#ifdef USE_ROCM
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// GELU, tanh approximation, in float32: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3),
// written as x / (1 + exp(-2u)) = x / (1 + 2^(x (c + c 0.044715 x^2))), c = -2 sqrt(2/pi) log2(e):
// two multiplies, one FMA, one exp2 and one division a value, accurate to a few ulp also where
// the GELU is tiny (the Triton kernel, omni_kernels/quant/activated_triton_kernel.py, computes
// the same).
__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float kC = -2.0f * 0.7978845608028654f * 1.4426950408889634f;
  constexpr float kCubic = kC * 0.044715f;
  return __fdividef(x, 1.0f + exp2_ftz(x * fmaf(kCubic, x * x, kC)));
}

// kGelu: the row is cat(prefix, x) (prefix optional) with the GELU on columns >= p.gelu_from;
// only instantiated with NormKind::kNone.
template <typename T, OutKind kOut, int kVecs, NormKind kNorm, bool kGelu>
__global__ void __launch_bounds__(kMaxThreads) quantize_per_token_kernel(const Params p) {
  static_assert(!kGelu || kNorm == NormKind::kNone, "the GELU path has no norm");
  __shared__ float reduce_shared[kMaxThreads / OMNI_WARP_SIZE];
  using Traits = QuantTraits<kOut>;

  const int64_t row = blockIdx.x;
  const T* x_row = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const float cols = static_cast<float>(p.cols);

  // Issue every load of the row before the first reduction.
  float v[kVecs][kVectorElements];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    if (idx < p.row_vectors) {
      if constexpr (kGelu) {
        const T* src = idx < p.prefix_vectors
                           ? static_cast<const T*>(p.prefix) + row * p.prefix_row_stride +
                                 static_cast<int64_t>(idx) * kVectorElements
                           : x_row + static_cast<int64_t>(idx - p.prefix_vectors) * kVectorElements;
        load_vector(src, v[i]);
      } else {
        load_vector(x_row + static_cast<int64_t>(idx) * kVectorElements, v[i]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) v[i][j] = 0.0f;
    }
  }

  if constexpr (kGelu) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int first_col = (threadIdx.x + i * blockDim.x) * kVectorElements;
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) {
        if (first_col + j >= p.gelu_from) v[i][j] = gelu_tanh(v[i][j]);  // gelu(0) = 0 past the row
      }
    }
  }

  float mean = 0.0f, rstd = 1.0f;
  if constexpr (kNorm == NormKind::kLayer) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i)
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) sum += v[i][j];
    mean = block_reduce<SumOp>(sum, reduce_shared) / cols;
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (static_cast<int>(threadIdx.x + i * blockDim.x) >= p.row_vectors) continue;
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) {
        const float d = v[i][j] - mean;
        sum_sq += d * d;
      }
    }
    rstd = 1.0f / sqrtf(block_reduce<SumOp>(sum_sq, reduce_shared) / cols + p.eps);
  } else if constexpr (kNorm == NormKind::kRms) {
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i)
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) sum_sq += v[i][j] * v[i][j];
    rstd = 1.0f / sqrtf(block_reduce<SumOp>(sum_sq, reduce_shared) / cols + p.eps);
  }

  const int64_t mod_row = (row / p.rows_per_group) * static_cast<int64_t>(p.cols);
  float absmax = 0.0f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    if (idx >= p.row_vectors) continue;  // v[i] stays 0: no effect on the maximum
    const int64_t col = static_cast<int64_t>(idx) * kVectorElements;
    float w[kVectorElements];
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      if constexpr (kNorm == NormKind::kLayer) v[i][j] = (v[i][j] - mean) * rstd;
      if constexpr (kNorm == NormKind::kRms) v[i][j] = v[i][j] * rstd;
    }
    if (p.norm_weight != nullptr) {
      load_half_or_float_vector<T>(p.norm_weight, p.norm_weight_fp32, col, w);
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) v[i][j] *= w[j];
    }
    if (p.norm_bias != nullptr) {
      load_half_or_float_vector<T>(p.norm_bias, p.norm_bias_fp32, col, w);
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) v[i][j] += w[j];
    }
    if (p.mod_scale != nullptr) {
      load_half_or_float_vector<T>(p.mod_scale, p.mod_scale_fp32, mod_row + col, w);
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) v[i][j] *= 1.0f + w[j];
    }
    if (p.mod_shift != nullptr) {
      load_half_or_float_vector<T>(p.mod_shift, p.mod_shift_fp32, mod_row + col, w);
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) v[i][j] += w[j];
    }
    if (p.clamp > 0.0f) {
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) v[i][j] = fminf(fmaxf(v[i][j], -p.clamp), p.clamp);
    }
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) absmax = fmaxf(absmax, fabsf(v[i][j]));
  }
  const float amax = fmaxf(block_reduce<MaxOp>(absmax, reduce_shared), kMinAbsmax);
  if (threadIdx.x == 0) p.scale[row] = amax / Traits::kMax;
  const float inv = Traits::kMax / amax;

  uint2* q_row = reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.q) + row * p.cols);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    if (idx >= p.row_vectors) continue;
    float out[kVectorElements];
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      out[j] = fminf(fmaxf(v[i][j] * inv, -Traits::kMax), Traits::kMax);
    }
    q_row[idx] = Traits::pack(out);
  }
}

template <typename T, OutKind kOut, NormKind kNorm, bool kGelu = false>
void launch_for_norm(const Params& params, int64_t rows, int vectors_per_thread, int threads,
                     cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows));
  const dim3 block(threads);
  switch (vectors_per_thread) {
    case 1:
      quantize_per_token_kernel<T, kOut, 1, kNorm, kGelu><<<grid, block, 0, stream>>>(params);
      break;
    case 2:
      quantize_per_token_kernel<T, kOut, 2, kNorm, kGelu><<<grid, block, 0, stream>>>(params);
      break;
    case 4:
      quantize_per_token_kernel<T, kOut, 4, kNorm, kGelu><<<grid, block, 0, stream>>>(params);
      break;
    default:
      quantize_per_token_kernel<T, kOut, 8, kNorm, kGelu><<<grid, block, 0, stream>>>(params);
      break;
  }
}

template <typename T, OutKind kOut>
void launch_for_out(const Params& params, int64_t rows, NormKind norm, int vectors_per_thread,
                    int threads, cudaStream_t stream) {
  switch (norm) {
    case NormKind::kRms:
      launch_for_norm<T, kOut, NormKind::kRms>(params, rows, vectors_per_thread, threads, stream);
      break;
    case NormKind::kLayer:
      launch_for_norm<T, kOut, NormKind::kLayer>(params, rows, vectors_per_thread, threads,
                                                 stream);
      break;
    default:
      launch_for_norm<T, kOut, NormKind::kNone>(params, rows, vectors_per_thread, threads, stream);
      break;
  }
}

// Explicitly instantiated per dtype in quant_{bf16,fp16}.cu, so the two compile in parallel.
template <typename T>
void launch_quantize_per_token(const Params& params, int64_t rows, NormKind norm, OutKind out,
                               int vectors_per_thread, int threads, cudaStream_t stream) {
  if (out == OutKind::kFp8E4m3) {
    launch_for_out<T, OutKind::kFp8E4m3>(params, rows, norm, vectors_per_thread, threads, stream);
  } else {
    launch_for_out<T, OutKind::kInt8>(params, rows, norm, vectors_per_thread, threads, stream);
  }
}

template <typename T>
void launch_quantize_activated(const Params& params, int64_t rows, OutKind out,
                               int vectors_per_thread, int threads, cudaStream_t stream) {
  if (out == OutKind::kFp8E4m3) {
    launch_for_norm<T, OutKind::kFp8E4m3, NormKind::kNone, true>(params, rows, vectors_per_thread,
                                                                 threads, stream);
  } else {
    launch_for_norm<T, OutKind::kInt8, NormKind::kNone, true>(params, rows, vectors_per_thread,
                                                              threads, stream);
  }
}

}  // namespace quant
}  // namespace omni
