// Halo pack / assemble kernels for spatially-sharded convolutions (definition:
// omni_kernels/halo/reference.py). Tensors are 4-D [N, T, rows, W]; one thread block per
// (output row, chunk of columns), so each block is one coalesced row copy whose source
// (received halo row, shard row, edge row or zeros) is chosen once per block.
#pragma once

#include <cstdint>

#include "../cuda_compat.h"

namespace omni {
namespace halo {

constexpr int kThreads = 256;
// Columns per thread per block: 4 keeps enough bytes in flight per thread for a row copy to
// approach the HBM copy rate without vector-alignment requirements on the (strided) views.
constexpr int kColumnsPerThread = 4;
constexpr int kColumnsPerBlock = kThreads * kColumnsPerThread;

enum EdgeMode : int { kRecv = 0, kZero = 1, kReplicate = 2 };

struct Strides4 {
  int64_t n, t, h, w;
};

template <typename T>
__global__ void halo_pack_kernel(const T* __restrict__ x, T* __restrict__ send_lo,
                                 T* __restrict__ send_hi, int64_t frames, int64_t h, int64_t w,
                                 int64_t n_lo, int64_t n_hi, Strides4 sx) {
  const int64_t row = blockIdx.x;
  const int64_t rows = n_lo + n_hi;
  const int64_t i = row % rows;
  const int64_t nt = row / rows;
  const int64_t t = nt % frames;
  const int64_t n = nt / frames;
  int64_t src_row;
  T* dst;
  if (i < n_lo) {
    src_row = i;
    dst = send_lo + (nt * n_lo + i) * w;
  } else {
    src_row = h - n_hi + (i - n_lo);
    dst = send_hi + (nt * n_hi + (i - n_lo)) * w;
  }
  const T* src = x + n * sx.n + t * sx.t + src_row * sx.h;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kColumnsPerBlock + threadIdx.x;
#pragma unroll
  for (int k = 0; k < kColumnsPerThread; ++k) {
    const int64_t col = col0 + k * kThreads;
    if (col < w) dst[col] = src[col * sx.w];
  }
}

template <typename T>
__global__ void halo_assemble_kernel(const T* __restrict__ x, const T* __restrict__ recv_lo,
                                     const T* __restrict__ recv_hi, T* __restrict__ out,
                                     int64_t frames, int64_t h, int64_t w, int64_t lo, int64_t hi,
                                     Strides4 sx, Strides4 so, int lo_mode, int hi_mode) {
  const int64_t row = blockIdx.x;
  const int64_t rows = lo + h + hi;
  const int64_t i = row % rows;
  const int64_t nt = row / rows;
  const int64_t t = nt % frames;
  const int64_t n = nt / frames;
  // Source of output row i: a row of x (src_stride = sx.w), a contiguous halo row, or zeros.
  const T* src = nullptr;
  int64_t src_stride = 1;
  if (i < lo) {
    if (lo_mode == kRecv) {
      src = recv_lo + (nt * lo + i) * w;
    } else if (lo_mode == kReplicate) {
      src = x + n * sx.n + t * sx.t;
      src_stride = sx.w;
    }
  } else if (i >= lo + h) {
    if (hi_mode == kRecv) {
      src = recv_hi + (nt * hi + (i - lo - h)) * w;
    } else if (hi_mode == kReplicate) {
      src = x + n * sx.n + t * sx.t + (h - 1) * sx.h;
      src_stride = sx.w;
    }
  } else {
    src = x + n * sx.n + t * sx.t + (i - lo) * sx.h;
    src_stride = sx.w;
  }
  T* dst = out + n * so.n + t * so.t + i * so.h;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kColumnsPerBlock + threadIdx.x;
#pragma unroll
  for (int k = 0; k < kColumnsPerThread; ++k) {
    const int64_t col = col0 + k * kThreads;
    if (col < w) dst[col * so.w] = src ? src[col * src_stride] : T(0);
  }
}

}  // namespace halo
}  // namespace omni
