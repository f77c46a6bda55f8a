// The halo kernels' launchers (halo_params.h), instantiated for each vector width (dense path)
// and element size (rows path). No torch header: halo.cpp does the checks and path choice.
#include <algorithm>

#include "halo_kernel.cuh"

namespace omni {
namespace halo {
namespace {

// Calls fn(vector type tag) for a vector width of `bytes` (16, 8, 4 or 2).
template <typename Fn>
void with_vector(int bytes, Fn&& fn) {
  switch (bytes) {
    case 16: fn(typename VectorOf<16>::type{}); break;
    case 8: fn(typename VectorOf<8>::type{}); break;
    case 4: fn(typename VectorOf<4>::type{}); break;
    default: fn(typename VectorOf<2>::type{}); break;
  }
}

// Calls fn(element type tag) for elements of `bytes` (2, 4 or 8), moved as raw bits.
template <typename Fn>
void with_element(int bytes, Fn&& fn) {
  switch (bytes) {
    case 8: fn(uint64_t{}); break;
    case 4: fn(uint32_t{}); break;
    default: fn(uint16_t{}); break;
  }
}

dim3 dense_grid(int64_t vectors_per_slab, int64_t slabs) {
  return dim3(static_cast<unsigned>((vectors_per_slab + kVectorsPerBlock - 1) / kVectorsPerBlock),
              static_cast<unsigned>(std::min(slabs, kMaxGridY)));
}

dim3 rows_grid(int64_t rows, int64_t slabs) {
  return dim3(static_cast<unsigned>(rows), static_cast<unsigned>(std::min(slabs, kMaxGridY)));
}

}  // namespace

void launch_pack_dense(int vector_bytes, const void* x, void* send_lo, void* send_hi,
                       const DensePack& args, cudaStream_t stream) {
  with_vector(vector_bytes, [&](auto tag) {
    using V = decltype(tag);
    halo_pack_dense_kernel<V><<<dense_grid(args.total, args.slabs), kDenseThreads, 0, stream>>>(
        static_cast<const V*>(x), static_cast<V*>(send_lo), static_cast<V*>(send_hi), args);
  });
}

void launch_assemble_dense(int vector_bytes, const void* x, const void* recv_lo,
                           const void* recv_hi, void* out, const DenseAssemble& args,
                           cudaStream_t stream) {
  with_vector(vector_bytes, [&](auto tag) {
    using V = decltype(tag);
    halo_assemble_dense_kernel<V><<<dense_grid(args.total, args.slabs), kDenseThreads, 0, stream>>>(
        static_cast<const V*>(x), static_cast<const V*>(recv_lo), static_cast<const V*>(recv_hi),
        static_cast<V*>(out), args);
  });
}

void launch_pack_rows(int element_bytes, const void* x, void* send_lo, void* send_hi,
                      int64_t frames, int64_t slabs, int64_t h, int64_t w, int64_t n_lo,
                      int64_t n_hi, Strides4 sx, cudaStream_t stream) {
  with_element(element_bytes, [&](auto tag) {
    using T = decltype(tag);
    halo_pack_rows_kernel<T><<<rows_grid(n_lo + n_hi, slabs), kRowThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(send_lo), static_cast<T*>(send_hi), frames,
        slabs, h, w, n_lo, n_hi, sx);
  });
}

void launch_assemble_rows(int element_bytes, const void* x, const void* recv_lo,
                          const void* recv_hi, void* out, int64_t frames, int64_t slabs,
                          int64_t h, int64_t w, int64_t lo, int64_t hi, Strides4 sx, Strides4 so,
                          int lo_mode, int hi_mode, cudaStream_t stream) {
  with_element(element_bytes, [&](auto tag) {
    using T = decltype(tag);
    halo_assemble_rows_kernel<T><<<rows_grid(lo + h + hi, slabs), kRowThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(recv_lo), static_cast<const T*>(recv_hi),
        static_cast<T*>(out), frames, slabs, h, w, lo, hi, sx, so, lo_mode, hi_mode);
  });
}

}  // namespace halo
}  // namespace omni
