// Host side of the fused QK-RMSNorm + RoPE op: argument checks and launch.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../ops.h"
#include "qk_norm_rope_params.h"

namespace {

using omni::qk_norm_rope::kMaxThreads;
using omni::qk_norm_rope::kVectorElements;

void check_rows(const torch::Tensor& t, const char* name, int64_t head_dim) {
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D [B, S, H, D]; got ", t.sizes());
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.size(3) == head_dim, name, " must have head_dim ", head_dim, "; got ", t.size(3));
  TORCH_CHECK(t.stride(3) == 1 && t.stride(2) == head_dim, name,
              " must have packed heads (strides [*, *, D, 1]); got ", t.strides());
  TORCH_CHECK(t.stride(0) % kVectorElements == 0 && t.stride(1) % kVectorElements == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              name, " rows must be 16-byte aligned (strides multiple of ", kVectorElements,
              " elements, 16-byte aligned start); got strides ", t.strides());
}

const void* checked_weight(const std::optional<torch::Tensor>& weight, const char* name,
                           int64_t numel, const torch::Tensor& x, bool* is_fp32) {
  *is_fp32 = false;
  if (!weight.has_value()) return nullptr;
  const torch::Tensor& w = *weight;
  TORCH_CHECK(w.is_cuda() && w.device() == x.device(), name, " must be on ", x.device());
  TORCH_CHECK(w.dim() == 1 && w.numel() == numel && w.is_contiguous(), name,
              " must be contiguous 1-D with ", numel, " elements; got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() || w.scalar_type() == torch::kFloat32, name,
              " must be ", x.scalar_type(), " or float32; got ", w.scalar_type());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned");
  *is_fp32 = w.scalar_type() == torch::kFloat32;
  return w.data_ptr();
}

void check_table(const torch::Tensor& t, const char* name, int64_t seq, int64_t head_dim,
                 const torch::Tensor& x) {
  TORCH_CHECK(t.device() == x.device(), name, " must be on ", x.device());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() &&
                  t.numel() == seq * head_dim,
              name, " must be contiguous float32 [S, D] = [", seq, ", ", head_dim, "]; got ",
              t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned");
}

}  // namespace

void qk_rmsnorm_rope(torch::Tensor& q_out, torch::Tensor& k_out, const torch::Tensor& q,
                     const torch::Tensor& k, const std::optional<torch::Tensor>& q_weight,
                     const std::optional<torch::Tensor>& k_weight, const torch::Tensor& cos,
                     const torch::Tensor& sin, double eps, bool interleaved,
                     bool norm_across_heads) {
  const int64_t head_dim = q.size(-1);
  TORCH_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256,
              "qk_rmsnorm_rope: head_dim must be 64, 128 or 256; got ", head_dim);
  check_rows(q, "q", head_dim);
  check_rows(k, "k", head_dim);
  check_rows(q_out, "q_out", head_dim);
  check_rows(k_out, "k_out", head_dim);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == torch::kHalf || dtype == torch::kBFloat16,
              "qk_rmsnorm_rope: q must be float16 or bfloat16; got ", dtype);
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&k, &q_out, &k_out}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->device() == q.device(),
                "qk_rmsnorm_rope: q, k, q_out, k_out must share dtype and device");
  }
  const int64_t batch = q.size(0), seq = q.size(1);
  TORCH_CHECK(k.size(0) == batch && k.size(1) == seq, "k must match q in B and S; got ",
              k.sizes(), " vs ", q.sizes());
  TORCH_CHECK(q_out.sizes() == q.sizes() && k_out.sizes() == k.sizes(),
              "q_out/k_out must match q/k in shape");
  check_table(cos, "cos", seq, head_dim, q);
  check_table(sin, "sin", seq, head_dim, q);

  const int64_t heads_q = q.size(2), heads_k = k.size(2);
  omni::qk_norm_rope::Params params{};
  params.q_weight = checked_weight(q_weight, "q_weight",
                                   norm_across_heads ? heads_q * head_dim : head_dim, q,
                                   &params.q_weight_fp32);
  params.k_weight = checked_weight(k_weight, "k_weight",
                                   norm_across_heads ? heads_k * head_dim : head_dim, q,
                                   &params.k_weight_fp32);

  // One thread per 16-byte vector of the longer row, rounded up to whole warps.
  const int64_t row_vectors = std::max(heads_q, heads_k) * head_dim / kVectorElements;
  const int64_t warps = (row_vectors + OMNI_WARP_SIZE - 1) / OMNI_WARP_SIZE;
  const int threads = static_cast<int>(std::min<int64_t>(warps * OMNI_WARP_SIZE, kMaxThreads));
  // The across-heads mean square is reduced over the whole block in one pass.
  TORCH_CHECK(!norm_across_heads || row_vectors <= kMaxThreads,
              "qk_rmsnorm_rope: norm_across_heads supports H*D <= ", kMaxThreads * kVectorElements,
              " on the CUDA backend; got ", std::max(heads_q, heads_k) * head_dim,
              " (use backend='triton')");
  if (batch * seq == 0) return;

  params.q = q.data_ptr();
  params.k = k.data_ptr();
  params.q_out = q_out.data_ptr();
  params.k_out = k_out.data_ptr();
  params.cos = cos.data_ptr<float>();
  params.sin = sin.data_ptr<float>();
  params.q_batch_stride = q.stride(0);
  params.q_seq_stride = q.stride(1);
  params.k_batch_stride = k.stride(0);
  params.k_seq_stride = k.stride(1);
  params.q_out_batch_stride = q_out.stride(0);
  params.q_out_seq_stride = q_out.stride(1);
  params.k_out_batch_stride = k_out.stride(0);
  params.k_out_seq_stride = k_out.stride(1);
  params.seq_len = static_cast<int>(seq);
  params.heads_q = static_cast<int>(heads_q);
  params.heads_k = static_cast<int>(heads_k);
  params.eps = static_cast<float>(eps);

  const c10::cuda::CUDAGuard device_guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (dtype == torch::kBFloat16) {
    omni::qk_norm_rope::launch_qk_rmsnorm_rope<__nv_bfloat16>(
        params, batch * seq, static_cast<int>(head_dim), interleaved, norm_across_heads, threads,
        stream);
  } else {
    omni::qk_norm_rope::launch_qk_rmsnorm_rope<__half>(params, batch * seq,
                                                       static_cast<int>(head_dim), interleaved,
                                                       norm_across_heads, threads, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
