// Per-token quantization without a norm (plain, or with the GELU folded in): the row staged in
// shared memory. The kernel template and its launcher.
//
// Same operation as quant_kernel.cuh's NormKind::kNone instantiations (reference:
// omni_kernels/quant/reference.py), scheduled for memory-level parallelism instead: the register
// kernel keeps the row in float32 registers, which at Flux's widths (12288-15360 values) holds
// so many registers a row that only ~2 rows are in flight on an SM and each row's load,
// reduction and store run one after the other (far below read bandwidth). Here each thread issues
// asynchronous 16-byte copies (cp.async) of its vectors into shared memory as the 16-bit input
// (2 bytes a value, no registers held across the copy), then both passes read the staged row:
// pass 1 the absolute maximum, pass 2 the codes. Small blocks and little shared memory a row
// (30 KB at 15360 bf16 values) keep ~7 rows a SM in flight at Flux's widths, ~20 at 3072.
//
// With the GELU, pass 1 needs no GELU: gelu_tanh is increasing for x >= -0.7525 and above
// -0.1701 everywhere, so when gelu(max x) >= kGeluMinimumBound, max |gelu(x)| over the row's
// GELU columns is gelu(max x). Only rows whose GELU never reaches that bound (every value below
// ~0.26) take a second pass of GELUs for the maximum. The GELU is thus evaluated once a value.
//
// Pass 1's packed 16-bit maxima and the ex2.approx.ftz GELU keep the GELU-folded kernel from
// being compute-bound. Measurements: bench/results/INDEX.md.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifndef USE_ROCM
#include <cuda_pipeline.h>
#endif

#include "quant_kernel.cuh"

namespace omni {
namespace quant {

// |gelu_tanh(x)| <= 0.17005 for every x < 0 (minimum -0.170041 at x = -0.7525); a margin covers
// the float32 evaluation's few-ulp error.
constexpr float kGeluMinimumBound = 0.1705f;

// Copies 16 bytes global -> shared without holding registers (cp.async.cg: L2 only; each byte
// is read once). HIP: a plain load and store.
__device__ __forceinline__ void copy_vector_async(uint4* dst, const void* src) {
#ifdef USE_ROCM
  *dst = *static_cast<const uint4*>(src);
#else
  __pipeline_memcpy_async(dst, src, sizeof(uint4));
#endif
}

__device__ __forceinline__ void wait_vector_copies() {
#ifndef USE_ROCM
  __pipeline_commit();
  __pipeline_wait_prior(0);
#endif
  __syncthreads();
}

// The 8 values of staged vector `idx`, activated: GELU on columns >= gelu_from when kGelu.
template <typename T, bool kGelu>
__device__ __forceinline__ void staged_values(const uint4* row, int idx, int gelu_from,
                                              float (&v)[kVectorElements]) {
  load_vector(reinterpret_cast<const T*>(row + idx), v);
  if constexpr (kGelu) {
    const int first_col = idx * kVectorElements;
    if (first_col >= gelu_from) {
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) v[j] = gelu_tanh(v[j]);
    } else if (first_col + kVectorElements > gelu_from) {
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) {
        if (first_col + j >= gelu_from) v[j] = gelu_tanh(v[j]);
      }
    }
  }
}

// One block per row; p.row_vectors 16-byte vectors of dynamic shared memory. The row is
// cat(prefix, x) (prefix optional, p.prefix_vectors vectors) with the GELU on columns
// >= p.gelu_from when kGelu; without kGelu, p.gelu_from is ignored.
template <typename T, OutKind kOut, bool kGelu>
__global__ void __launch_bounds__(kStagedMaxThreads) quantize_staged_kernel(const Params p) {
  extern __shared__ uint4 staged_row[];
  __shared__ float reduce_shared[kStagedMaxThreads / OMNI_WARP_SIZE];
  using Traits = QuantTraits<kOut>;

  const int64_t row = blockIdx.x;
  const T* x_row = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const T* prefix_row =
      p.prefix_vectors > 0 ? static_cast<const T*>(p.prefix) + row * p.prefix_row_stride : nullptr;
  for (int idx = threadIdx.x; idx < p.row_vectors; idx += blockDim.x) {
    const T* src = idx < p.prefix_vectors
                       ? prefix_row + static_cast<int64_t>(idx) * kVectorElements
                       : x_row + static_cast<int64_t>(idx - p.prefix_vectors) * kVectorElements;
    copy_vector_async(staged_row + idx, src);
  }
  wait_vector_copies();

  // Pass 1: max |value| over the columns without GELU, max value over the GELU columns. Whole
  // vectors on one side of gelu_from (all but at most one) take packed 16-bit maxima: exact,
  // and a quarter of the instructions of converting every value first.
  using Pair = typename Packed2<T>::type;
  Pair plain_max2 = Packed2<T>::from_float2(make_float2(0.0f, 0.0f));
  Pair gelu_max2 = Packed2<T>::from_float2(make_float2(-INFINITY, -INFINITY));
  float plain_absmax = 0.0f;
  float gelu_argmax = -INFINITY;
  for (int idx = threadIdx.x; idx < p.row_vectors; idx += blockDim.x) {
    const uint4 raw = staged_row[idx];
    const Pair* pairs = reinterpret_cast<const Pair*>(&raw);
    const int first_col = idx * kVectorElements;
    if (kGelu && first_col >= p.gelu_from) {
#pragma unroll
      for (int i = 0; i < kVectorElements / 2; ++i) gelu_max2 = __hmax2(gelu_max2, pairs[i]);
    } else if (!kGelu || first_col + kVectorElements <= p.gelu_from) {
#pragma unroll
      for (int i = 0; i < kVectorElements / 2; ++i) plain_max2 = __hmax2(plain_max2, __habs2(pairs[i]));
    } else {
      float v[kVectorElements];
      load_vector(reinterpret_cast<const T*>(staged_row + idx), v);
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) {
        if (first_col + j >= p.gelu_from) {
          gelu_argmax = fmaxf(gelu_argmax, v[j]);
        } else {
          plain_absmax = fmaxf(plain_absmax, fabsf(v[j]));
        }
      }
    }
  }
  const float2 plain_pair = Packed2<T>::to_float2(plain_max2);
  plain_absmax = fmaxf(plain_absmax, fmaxf(plain_pair.x, plain_pair.y));
  float absmax = block_reduce<MaxOp>(plain_absmax, reduce_shared);
  if constexpr (kGelu) {
    const float2 gelu_pair = Packed2<T>::to_float2(gelu_max2);
    gelu_argmax = fmaxf(gelu_argmax, fmaxf(gelu_pair.x, gelu_pair.y));
    // NaN (no GELU column at all: gelu(-inf)) fails the test and takes the direct way.
    const float gelu_max = gelu_tanh(block_reduce<MaxOp>(gelu_argmax, reduce_shared));
    if (gelu_max >= kGeluMinimumBound) {
      absmax = fmaxf(absmax, gelu_max);
    } else {
      // Block-uniform: every value's GELU is small; take the maximum the direct way.
      float gelu_absmax = 0.0f;
      for (int idx = threadIdx.x; idx < p.row_vectors; idx += blockDim.x) {
        if ((idx + 1) * kVectorElements <= p.gelu_from) continue;
        float v[kVectorElements];
        staged_values<T, true>(staged_row, idx, p.gelu_from, v);
        const int first_col = idx * kVectorElements;
#pragma unroll
        for (int j = 0; j < kVectorElements; ++j) {
          if (first_col + j >= p.gelu_from) gelu_absmax = fmaxf(gelu_absmax, fabsf(v[j]));
        }
      }
      absmax = fmaxf(absmax, block_reduce<MaxOp>(gelu_absmax, reduce_shared));
    }
  }
  // Clamping each value to [-clamp, clamp] caps the maximum of their magnitudes the same way.
  if (p.clamp > 0.0f) absmax = fminf(absmax, p.clamp);
  const float amax = fmaxf(absmax, kMinAbsmax);
  if (threadIdx.x == 0) p.scale[row] = amax / Traits::kMax;
  const float inv = Traits::kMax / amax;

  // Pass 2: the codes, 8 bytes a vector. FP8's saturating conversion already clamps to +-448.
  uint2* q_row = reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.q) + row * p.cols);
#pragma unroll 2
  for (int idx = threadIdx.x; idx < p.row_vectors; idx += blockDim.x) {
    float v[kVectorElements];
    staged_values<T, kGelu>(staged_row, idx, p.gelu_from, v);
    if (p.clamp > 0.0f) {
#pragma unroll
      for (int j = 0; j < kVectorElements; ++j) v[j] = fminf(fmaxf(v[j], -p.clamp), p.clamp);
    }
#pragma unroll
    for (int j = 0; j < kVectorElements; ++j) {
      v[j] *= inv;
      if constexpr (kOut == OutKind::kInt8) v[j] = fminf(fmaxf(v[j], -Traits::kMax), Traits::kMax);
    }
    q_row[idx] = Traits::pack(v);
  }
}

template <typename T, OutKind kOut>
void launch_staged_for_out(const Params& params, int64_t rows, bool gelu, int threads,
                           cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows));
  const dim3 block(threads);
  const size_t shared_bytes = static_cast<size_t>(params.row_vectors) * sizeof(uint4);
  if (gelu) {
    quantize_staged_kernel<T, kOut, true><<<grid, block, shared_bytes, stream>>>(params);
  } else {
    quantize_staged_kernel<T, kOut, false><<<grid, block, shared_bytes, stream>>>(params);
  }
}

// Explicitly instantiated per dtype in quant_staged_{bf16,fp16}.cu.
template <typename T>
void launch_quantize_staged(const Params& params, int64_t rows, OutKind out, bool gelu,
                            int threads, cudaStream_t stream) {
  if (out == OutKind::kFp8E4m3) {
    launch_staged_for_out<T, OutKind::kFp8E4m3>(params, rows, gelu, threads, stream);
  } else {
    launch_staged_for_out<T, OutKind::kInt8>(params, rows, gelu, threads, stream);
  }
}

}  // namespace quant
}  // namespace omni
