// Host side of the halo pack / assemble ops: argument checks, dtype dispatch, launch.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../ops.h"
#include "halo_kernel.cuh"

namespace {

using omni::halo::kColumnsPerBlock;
using omni::halo::kThreads;
using omni::halo::Strides4;

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

dim3 grid_for(int64_t rows, int64_t w) {
  TORCH_CHECK(rows < (int64_t{1} << 31), "halo: too many rows for one launch: ", rows);
  return dim3(static_cast<unsigned>(rows),
              static_cast<unsigned>((w + kColumnsPerBlock - 1) / kColumnsPerBlock));
}

}  // namespace

void halo_pack(const torch::Tensor& x, torch::Tensor& send_lo, torch::Tensor& send_hi) {
  TORCH_CHECK(x.dim() == 4 && x.is_cuda(), "halo_pack: x must be a 4-D CUDA tensor [N, T, h, W]");
  const int64_t n_lo = send_lo.size(2), n_hi = send_hi.size(2);
  TORCH_CHECK(n_lo <= x.size(2) && n_hi <= x.size(2), "halo_pack: more halo rows than x has");
  check_rows(send_lo, "send_lo", x, n_lo, true);
  check_rows(send_hi, "send_hi", x, n_hi, true);
  const int64_t rows = x.size(0) * x.size(1) * (n_lo + n_hi);
  if (rows == 0 || x.size(3) == 0) return;
  const at::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "halo_pack", [&] {
    omni::halo::halo_pack_kernel<scalar_t><<<grid_for(rows, x.size(3)), kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), send_lo.data_ptr<scalar_t>(), send_hi.data_ptr<scalar_t>(),
        x.size(1), x.size(2), x.size(3), n_lo, n_hi, strides_of(x));
  });
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
  const bool lo_recv = lo_mode == omni::halo::kRecv && lo_rows > 0;
  const bool hi_recv = hi_mode == omni::halo::kRecv && hi_rows > 0;
  TORCH_CHECK(!lo_recv || recv_lo.has_value(), "halo_assemble: recv_lo is required in recv mode");
  TORCH_CHECK(!hi_recv || recv_hi.has_value(), "halo_assemble: recv_hi is required in recv mode");
  if (lo_recv) check_rows(*recv_lo, "recv_lo", x, lo_rows, true);
  if (hi_recv) check_rows(*recv_hi, "recv_hi", x, hi_rows, true);
  TORCH_CHECK(x.size(2) > 0 || (lo_mode != omni::halo::kReplicate &&
                                hi_mode != omni::halo::kReplicate),
              "halo_assemble: replicate mode needs at least one row of x");
  const int64_t rows = x.size(0) * x.size(1) * (lo_rows + x.size(2) + hi_rows);
  if (rows == 0 || x.size(3) == 0) return;
  const at::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "halo_assemble", [&] {
    omni::halo::halo_assemble_kernel<scalar_t><<<grid_for(rows, x.size(3)), kThreads, 0,
                                                  stream>>>(
        x.data_ptr<scalar_t>(), lo_recv ? recv_lo->data_ptr<scalar_t>() : nullptr,
        hi_recv ? recv_hi->data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), x.size(1),
        x.size(2), x.size(3), lo_rows, hi_rows, strides_of(x), strides_of(out),
        static_cast<int>(lo_mode), static_cast<int>(hi_mode));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
