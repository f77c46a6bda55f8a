// 16-byte vector loads and stores of half-precision rows, converted to and from float32.
// Shared by the kernels that stream fp16/bf16 rows (qk_norm_rope, quant).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace omni {

constexpr int kHalfVectorElements = 8;  // 16 bytes of fp16/bf16

template <typename T>
struct Packed2;
template <>
struct Packed2<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type v) { return __half22float2(v); }
  static __device__ __forceinline__ type from_float2(float2 v) { return __float22half2_rn(v); }
};
template <>
struct Packed2<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ type from_float2(float2 v) { return __float22bfloat162_rn(v); }
};

// Loads 8 values of T at ptr (16-byte aligned) as float.
template <typename T>
__device__ __forceinline__ void load_vector(const T* ptr, float (&out)[kHalfVectorElements]) {
  using P = Packed2<T>;
  const uint4 raw = *reinterpret_cast<const uint4*>(ptr);
  const typename P::type* pairs = reinterpret_cast<const typename P::type*>(&raw);
#pragma unroll
  for (int i = 0; i < kHalfVectorElements / 2; ++i) {
    const float2 f = P::to_float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Rounds 8 floats to T and stores them at ptr (16-byte aligned) in one access.
template <typename T>
__device__ __forceinline__ void store_vector(T* ptr, const float (&values)[kHalfVectorElements]) {
  using P = Packed2<T>;
  uint4 raw;
  typename P::type* pairs = reinterpret_cast<typename P::type*>(&raw);
#pragma unroll
  for (int i = 0; i < kHalfVectorElements / 2; ++i) {
    pairs[i] = P::from_float2(make_float2(values[2 * i], values[2 * i + 1]));
  }
  *reinterpret_cast<uint4*>(ptr) = raw;
}

// Loads 8 float32 values at ptr (16-byte aligned).
__device__ __forceinline__ void load_float_vector(const float* ptr,
                                                  float (&out)[kHalfVectorElements]) {
  const float4 lo = *reinterpret_cast<const float4*>(ptr);
  const float4 hi = *reinterpret_cast<const float4*>(ptr + 4);
  out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
  out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
}

// Loads 8 values at element `offset` of a T or float32 array (which one is known at run time:
// parameters such as norm weights come in either dtype).
template <typename T>
__device__ __forceinline__ void load_half_or_float_vector(const void* base, bool is_fp32,
                                                          int64_t offset,
                                                          float (&out)[kHalfVectorElements]) {
  if (is_fp32) {
    load_float_vector(static_cast<const float*>(base) + offset, out);
  } else {
    load_vector(static_cast<const T*>(base) + offset, out);
  }
}

}  // namespace omni
