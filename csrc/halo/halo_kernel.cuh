// Halo pack / assemble kernels for spatially-sharded convolutions (definition:
// omni_kernels/halo/reference.py). Tensors are 4-D [N, T, rows, W]; a (n, t) pair is a "slab".
//
// Two paths, chosen on the host (halo.cpp):
// * dense: every tensor's rows are back to back in a slab (column stride 1, row stride W) and
//   the widths, slab strides and pointers are multiples of the vector width. A slab's rows are
//   then one flat run, copied as 16/8/4/2-byte vectors with no per-element division: a vector
//   never straddles rows, its source (received halo, shard, zeros, edge row) follows from two
//   comparisons of its index in the slab. Dtype-agnostic (it moves bytes).
// * rows: any strides; one block per (output row, slab), a scalar loop over the columns.
#pragma once

#include <cstdint>
#include <type_traits>

#include "halo_params.h"

namespace omni {
namespace halo {

// The unsigned type of kBytes bytes (16, 8, 4 or 2) the dense kernels move.
template <int kBytes>
struct VectorOf {
  static_assert(kBytes == 16 || kBytes == 8 || kBytes == 4 || kBytes == 2, "vector bytes");
  using type = std::conditional_t<
      kBytes == 16, uint4,
      std::conditional_t<kBytes == 8, uint2, std::conditional_t<kBytes == 4, uint32_t, uint16_t>>>;
};

template <typename V>
__device__ __forceinline__ V assembled_vector(int v, const V* __restrict__ xs,
                                              const V* __restrict__ lo_s,
                                              const V* __restrict__ hi_s, const DenseAssemble& a) {
  if (v < a.lo_end) {
    if (a.lo_mode == kRecv) return lo_s[v];
    if (a.lo_mode == kZero) return V{};
    return xs[v % a.row];  // replicate x's first row (edge rows only: the division is rare)
  }
  if (v < a.mid_end) return xs[v - a.lo_end];
  const int j = v - a.mid_end;
  if (a.hi_mode == kRecv) return hi_s[j];
  if (a.hi_mode == kZero) return V{};
  return xs[(a.h_rows - 1) * a.row + j % a.row];
}

template <typename V>
__global__ void __launch_bounds__(kDenseThreads)
    halo_assemble_dense_kernel(const V* __restrict__ x, const V* __restrict__ recv_lo,
                               const V* __restrict__ recv_hi, V* __restrict__ out,
                               DenseAssemble a) {
  const int v0 = blockIdx.x * kVectorsPerBlock + threadIdx.x;
  const int hi_len = a.total - a.mid_end;
  for (int64_t nt = blockIdx.y; nt < a.slabs; nt += gridDim.y) {
    const int64_t n = nt / a.frames, t = nt - n * a.frames;
    const V* xs = x + n * a.x_sn + t * a.x_st;
    const V* lo_s = recv_lo + nt * a.lo_end;  // received rows: contiguous [N, T, lo, W]
    const V* hi_s = recv_hi + nt * hi_len;
    V* os = out + n * a.o_sn + t * a.o_st;
    // All loads first, then all stores: kVectorsPerThread vectors in flight per thread.
    V vals[kVectorsPerThread];
#pragma unroll
    for (int k = 0; k < kVectorsPerThread; ++k) {
      const int v = v0 + k * kDenseThreads;
      if (v < a.total) vals[k] = assembled_vector(v, xs, lo_s, hi_s, a);
    }
#pragma unroll
    for (int k = 0; k < kVectorsPerThread; ++k) {
      const int v = v0 + k * kDenseThreads;
      if (v < a.total) os[v] = vals[k];
    }
  }
}

template <typename V>
__global__ void __launch_bounds__(kDenseThreads)
    halo_pack_dense_kernel(const V* __restrict__ x, V* __restrict__ send_lo,
                           V* __restrict__ send_hi, DensePack a) {
  const int v0 = blockIdx.x * kVectorsPerBlock + threadIdx.x;
  const int hi_len = a.total - a.lo_end;
  for (int64_t nt = blockIdx.y; nt < a.slabs; nt += gridDim.y) {
    const int64_t n = nt / a.frames, t = nt - n * a.frames;
    const V* xs = x + n * a.x_sn + t * a.x_st;
    V vals[kVectorsPerThread];
#pragma unroll
    for (int k = 0; k < kVectorsPerThread; ++k) {
      const int v = v0 + k * kDenseThreads;
      if (v < a.total) vals[k] = v < a.lo_end ? xs[v] : xs[a.hi_src + v - a.lo_end];
    }
#pragma unroll
    for (int k = 0; k < kVectorsPerThread; ++k) {
      const int v = v0 + k * kDenseThreads;
      if (v < a.lo_end) {
        send_lo[nt * a.lo_end + v] = vals[k];
      } else if (v < a.total) {
        send_hi[nt * hi_len + v - a.lo_end] = vals[k];
      }
    }
  }
}

// Rows path: block (i, slab) copies output row i of each slab it visits.
template <typename T>
__global__ void halo_pack_rows_kernel(const T* __restrict__ x, T* __restrict__ send_lo,
                                      T* __restrict__ send_hi, int64_t frames, int64_t slabs,
                                      int64_t h, int64_t w, int64_t n_lo, int64_t n_hi,
                                      Strides4 sx) {
  const int64_t i = blockIdx.x;
  const int64_t src_row = i < n_lo ? i : h - n_hi + (i - n_lo);
  for (int64_t nt = blockIdx.y; nt < slabs; nt += gridDim.y) {
    const int64_t n = nt / frames, t = nt - n * frames;
    T* dst = i < n_lo ? send_lo + (nt * n_lo + i) * w : send_hi + (nt * n_hi + (i - n_lo)) * w;
    const T* src = x + n * sx.n + t * sx.t + src_row * sx.h;
    for (int64_t col = threadIdx.x; col < w; col += kRowThreads) dst[col] = src[col * sx.w];
  }
}

template <typename T>
__global__ void halo_assemble_rows_kernel(const T* __restrict__ x, const T* __restrict__ recv_lo,
                                          const T* __restrict__ recv_hi, T* __restrict__ out,
                                          int64_t frames, int64_t slabs, int64_t h, int64_t w,
                                          int64_t lo, int64_t hi, Strides4 sx, Strides4 so,
                                          int lo_mode, int hi_mode) {
  const int64_t i = blockIdx.x;
  for (int64_t nt = blockIdx.y; nt < slabs; nt += gridDim.y) {
    const int64_t n = nt / frames, t = nt - n * frames;
    // Source of output row i: a row of x (stride sx.w), a contiguous halo row, or zeros.
    const T* src = nullptr;
    int64_t src_stride = sx.w;
    if (i < lo) {
      if (lo_mode == kRecv) {
        src = recv_lo + (nt * lo + i) * w;
        src_stride = 1;
      } else if (lo_mode == kReplicate) {
        src = x + n * sx.n + t * sx.t;
      }
    } else if (i >= lo + h) {
      if (hi_mode == kRecv) {
        src = recv_hi + (nt * hi + (i - lo - h)) * w;
        src_stride = 1;
      } else if (hi_mode == kReplicate) {
        src = x + n * sx.n + t * sx.t + (h - 1) * sx.h;
      }
    } else {
      src = x + n * sx.n + t * sx.t + (i - lo) * sx.h;
    }
    T* dst = out + n * so.n + t * so.t + i * so.h;
    if (src == nullptr) {
      for (int64_t col = threadIdx.x; col < w; col += kRowThreads) dst[col * so.w] = T(0);
    } else {
      for (int64_t col = threadIdx.x; col < w; col += kRowThreads)
        dst[col * so.w] = src[col * src_stride];
    }
  }
}

}  // namespace halo
}  // namespace omni
