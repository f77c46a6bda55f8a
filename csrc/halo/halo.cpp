// Host side of the halo pack / assemble ops: argument checks, path choice (dense vectorized or
// strided rows, see halo_kernel.cuh), launch through halo.cu's launchers (halo_params.h).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <initializer_list>
#include <limits>

#include "../ops.h"
#include "halo_params.h"

namespace {

using namespace omni::halo;

Strides4 strides_of(const torch::Tensor& t) {
  return Strides4{t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

void check_rows(const torch::Tensor& t, const char* name, const torch::Tensor& x, int64_t rows,
                bool contiguous) {
  TORCH_CHECK(t.dim() == 4 && t.size(0) == x.size(0) && t.size(1) == x.size(1) &&
                  t.size(2) == rows && t.size(3) == x.size(3),
              name, " must be [N, T, ", rows, ", W] matching x ", x.sizes(), "; got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type() && t.device() == x.device(), name,
              " must share x's dtype and device");
  TORCH_CHECK(!contiguous || t.is_contiguous(), name, " must be contiguous");
}

// Rows of a slab back to back: column stride 1 and row stride W (a single row may have any).
bool rows_dense(const torch::Tensor& t) {
  return (t.size(3) <= 1 || t.stride(3) == 1) && (t.size(2) <= 1 || t.stride(2) == t.size(3));
}

// The widest vector (16, 8, 4 or 2 bytes, at least one element) that divides the row width,
// the slab strides and every pointer; 0 when a tensor is not rows-dense or a slab is too long
// for the kernels' 32-bit in-slab indices (the strided rows path runs then).
int dense_vector_bytes(std::initializer_list<const torch::Tensor*> tensors, int64_t slab_elems) {
  const int64_t esize = tensors.begin()[0]->element_size();
  if (slab_elems * esize / 2 >= std::numeric_limits<int32_t>::max()) return 0;
  for (const torch::Tensor* t : tensors) {
    if (!rows_dense(*t)) return 0;
  }
  for (int64_t bytes = 16; bytes >= std::max<int64_t>(2, esize); bytes /= 2) {
    bool ok = (tensors.begin()[0]->size(3) * esize) % bytes == 0;
    for (const torch::Tensor* t : tensors) {
      ok = ok && reinterpret_cast<uintptr_t>(t->data_ptr()) % bytes == 0 &&
           (t->stride(0) * esize) % bytes == 0 && (t->stride(1) * esize) % bytes == 0;
    }
    if (ok) return static_cast<int>(bytes);
  }
  return 0;
}

// The rows path copies elements as raw bits, for the dtypes it has always taken.
int rows_element_bytes(const torch::Tensor& x, const char* op, int64_t rows) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kDouble || dtype == torch::kHalf ||
                  dtype == torch::kBFloat16,
              op, ": strided (not rows-dense) tensors must be float32, float64, float16 or ",
              "bfloat16; got ", dtype);
  TORCH_CHECK(rows < (int64_t{1} << 31), "halo: too many rows for one launch: ", rows);
  return static_cast<int>(x.element_size());
}

}  // namespace

void halo_pack(const torch::Tensor& x, torch::Tensor& send_lo, torch::Tensor& send_hi) {
  TORCH_CHECK(x.dim() == 4 && x.is_cuda(), "halo_pack: x must be a 4-D CUDA tensor [N, T, h, W]");
  const int64_t n_lo = send_lo.size(2), n_hi = send_hi.size(2);
  TORCH_CHECK(n_lo <= x.size(2) && n_hi <= x.size(2), "halo_pack: more halo rows than x has");
  check_rows(send_lo, "send_lo", x, n_lo, true);
  check_rows(send_hi, "send_hi", x, n_hi, true);
  const int64_t frames = x.size(1), h = x.size(2), w = x.size(3);
  const int64_t slabs = x.size(0) * frames;
  if (slabs * (n_lo + n_hi) == 0 || w == 0) return;
  const at::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int bytes = dense_vector_bytes({&x, &send_lo, &send_hi}, h * w);
  if (bytes != 0) {
    const int64_t k = bytes / x.element_size();  // elements per vector
    const int64_t row = w / k;
    const DensePack args{x.stride(0) / k, x.stride(1) / k, slabs, static_cast<int>(frames),
                         static_cast<int>(n_lo * row), static_cast<int>((n_lo + n_hi) * row),
                         static_cast<int>((h - n_hi) * row)};
    launch_pack_dense(bytes, x.data_ptr(), send_lo.data_ptr(), send_hi.data_ptr(), args, stream);
  } else {
    launch_pack_rows(rows_element_bytes(x, "halo_pack", n_lo + n_hi), x.data_ptr(),
                     send_lo.data_ptr(), send_hi.data_ptr(), frames, slabs, h, w, n_lo, n_hi,
                     strides_of(x), stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void halo_assemble(const torch::Tensor& x, const std::optional<torch::Tensor>& recv_lo,
                   const std::optional<torch::Tensor>& recv_hi, torch::Tensor& out,
                   int64_t lo_rows, int64_t hi_rows, int64_t lo_mode, int64_t hi_mode) {
  TORCH_CHECK(x.dim() == 4 && x.is_cuda(),
              "halo_assemble: x must be a 4-D CUDA tensor [N, T, h, W]");
  TORCH_CHECK(lo_rows >= 0 && hi_rows >= 0, "halo_assemble: halo rows must be >= 0");
  TORCH_CHECK(lo_mode >= 0 && lo_mode <= 2 && hi_mode >= 0 && hi_mode <= 2,
              "halo_assemble: modes must be 0 (recv), 1 (zero) or 2 (replicate)");
  check_rows(out, "out", x, lo_rows + x.size(2) + hi_rows, false);
  const bool lo_recv = lo_mode == kRecv && lo_rows > 0;
  const bool hi_recv = hi_mode == kRecv && hi_rows > 0;
  TORCH_CHECK(!lo_recv || recv_lo.has_value(), "halo_assemble: recv_lo is required in recv mode");
  TORCH_CHECK(!hi_recv || recv_hi.has_value(), "halo_assemble: recv_hi is required in recv mode");
  if (lo_recv) check_rows(*recv_lo, "recv_lo", x, lo_rows, true);
  if (hi_recv) check_rows(*recv_hi, "recv_hi", x, hi_rows, true);
  TORCH_CHECK(x.size(2) > 0 || (lo_mode != kReplicate && hi_mode != kReplicate),
              "halo_assemble: replicate mode needs at least one row of x");
  const int64_t frames = x.size(1), h = x.size(2), w = x.size(3);
  const int64_t slabs = x.size(0) * frames;
  const int64_t rows = lo_rows + h + hi_rows;
  if (slabs * rows == 0 || w == 0) return;
  const at::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const torch::Tensor* lo_t = lo_recv ? &*recv_lo : nullptr;
  const torch::Tensor* hi_t = hi_recv ? &*recv_hi : nullptr;
  // The dense path checks the received buffers only when they are read.
  const int bytes = lo_t && hi_t ? dense_vector_bytes({&x, &out, lo_t, hi_t}, rows * w)
                    : lo_t       ? dense_vector_bytes({&x, &out, lo_t}, rows * w)
                    : hi_t       ? dense_vector_bytes({&x, &out, hi_t}, rows * w)
                                 : dense_vector_bytes({&x, &out}, rows * w);
  if (bytes != 0) {
    const int64_t k = bytes / x.element_size();  // elements per vector
    const int64_t row = w / k;
    const DenseAssemble args{x.stride(0) / k, x.stride(1) / k, out.stride(0) / k,
                             out.stride(1) / k, slabs, static_cast<int>(frames),
                             static_cast<int>(lo_rows * row), static_cast<int>((lo_rows + h) * row),
                             static_cast<int>(rows * row), static_cast<int>(row),
                             static_cast<int>(h), static_cast<int>(lo_mode),
                             static_cast<int>(hi_mode)};
    launch_assemble_dense(bytes, x.data_ptr(), lo_t ? lo_t->data_ptr() : nullptr,
                          hi_t ? hi_t->data_ptr() : nullptr, out.data_ptr(), args, stream);
  } else {
    launch_assemble_rows(rows_element_bytes(x, "halo_assemble", rows), x.data_ptr(),
                         lo_t ? lo_t->data_ptr() : nullptr, hi_t ? hi_t->data_ptr() : nullptr,
                         out.data_ptr(), frames, slabs, h, w, lo_rows, hi_rows, strides_of(x),
                         strides_of(out), static_cast<int>(lo_mode), static_cast<int>(hi_mode),
                         stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
