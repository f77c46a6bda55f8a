// Portability shims between CUDA and HIP (ROCm). Only what omni's kernels use.
#pragma once

#ifdef USE_ROCM
  #include <hip/hip_runtime.h>
  // HIP's wavefront-wide shuffles take no member mask.
  #define OMNI_SHFL_XOR(mask, var, lane_mask, width) __shfl_xor((var), (lane_mask), (width))
  #define OMNI_WARP_SIZE 64
#else
  #include <cuda_runtime.h>
  #define OMNI_SHFL_XOR(mask, var, lane_mask, width) \
    __shfl_xor_sync((mask), (var), (lane_mask), (width))
  #define OMNI_WARP_SIZE 32
#endif

#define OMNI_FULL_MASK 0xffffffffu
