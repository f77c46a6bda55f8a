// Host-visible parameters and launchers of the halo pack / assemble kernels (halo_kernel.cuh,
// instantiated in halo.cu). The torch-facing host side (checks, path choice) is halo.cpp: it
// includes no CUDA kernel code, and halo.cu no torch header (parsing torch in nvcc's three
// device passes made halo.cu the slowest file of the build).
#pragma once

#include <cstdint>

#include "../cuda_compat.h"

namespace omni {
namespace halo {

enum EdgeMode : int { kRecv = 0, kZero = 1, kReplicate = 2 };

struct Strides4 {
  int64_t n, t, h, w;
};

// Dense path: 256 threads x 4 vectors (64 KiB per block with 16-byte vectors) keeps enough
// bytes in flight per SM for a copy to run near the HBM rate.
constexpr int kDenseThreads = 256;
constexpr int kVectorsPerThread = 4;
constexpr int kVectorsPerBlock = kDenseThreads * kVectorsPerThread;
// Rows path (fallback for strided views).
constexpr int kRowThreads = 128;
// gridDim.y limit; larger slab counts loop.
constexpr int64_t kMaxGridY = 65535;

// Dense assemble. Counts and offsets in vectors: a slab of `out` holds `total` vectors, the
// first `lo_end` from the rows above, then x's rows up to `mid_end`, then the rows below;
// `row` vectors per row; x's and out's slab strides `x_sn, x_st, o_sn, o_st`.
struct DenseAssemble {
  int64_t x_sn, x_st, o_sn, o_st, slabs;
  int frames, lo_end, mid_end, total, row, h_rows, lo_mode, hi_mode;
};

// Dense pack: a slab of the send buffers is `lo_end` vectors (x's first rows) then
// `total - lo_end` vectors (x's rows from vector `hi_src` on).
struct DensePack {
  int64_t x_sn, x_st, slabs;
  int frames, lo_end, total, hi_src;
};

// Dense path: `vector_bytes` (16, 8, 4 or 2) the bytes a thread moves at once; pointers, slab
// strides and the row width are multiples of it (halo.cpp checks). Grid: ceil(total /
// kVectorsPerBlock) x min(slabs, kMaxGridY).
void launch_pack_dense(int vector_bytes, const void* x, void* send_lo, void* send_hi,
                       const DensePack& args, cudaStream_t stream);
void launch_assemble_dense(int vector_bytes, const void* x, const void* recv_lo,
                           const void* recv_hi, void* out, const DenseAssemble& args,
                           cudaStream_t stream);

// Rows path (any strides, in elements): elements of `element_bytes` (2, 4 or 8) copied as raw
// bits. One block per (output row, slab): rows < 2^31.
void launch_pack_rows(int element_bytes, const void* x, void* send_lo, void* send_hi,
                      int64_t frames, int64_t slabs, int64_t h, int64_t w, int64_t n_lo,
                      int64_t n_hi, Strides4 sx, cudaStream_t stream);
void launch_assemble_rows(int element_bytes, const void* x, const void* recv_lo,
                          const void* recv_hi, void* out, int64_t frames, int64_t slabs,
                          int64_t h, int64_t w, int64_t lo, int64_t hi, Strides4 sx, Strides4 so,
                          int lo_mode, int hi_mode, cudaStream_t stream);

}  // namespace halo
}  // namespace omni
