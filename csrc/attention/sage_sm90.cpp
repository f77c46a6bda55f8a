// Host entry of the Hopper quantized attention kernel (sage_sm90.cu): argument checks, then
// the launch. Inputs come from omni_kernels.attention.quantized.quantize.quantize_qkv with
// permute_v=True (V^T's keys permuted in groups of 16 as the kernel's P fragments need).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <cmath>
#include <limits>

#include "../ops.h"
#include "sage_sm90_params.h"

namespace {

using omni::attention::kSageBlockN;
using omni::attention::kSageHeadDim;

constexpr const char* kOp = "sage_attention_sm90";

void check_tensor(const torch::Tensor& t, const char* name, at::ScalarType dtype,
                  std::initializer_list<int64_t> shape, const torch::Tensor& like) {
  TORCH_CHECK(t.device() == like.device(), kOp, ": ", name, " must be on ", like.device(),
              "; got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, kOp, ": ", name, " must be ", dtype, "; got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == static_cast<int64_t>(shape.size()), kOp, ": ", name, " must be ",
              shape.size(), "-D; got ", t.dim(), "-D");
  int64_t d = 0;
  for (const int64_t expected : shape) {
    TORCH_CHECK(t.size(d) == expected, kOp, ": ", name, " dimension ", d, " must be ", expected,
                "; got ", t.size(d));
    ++d;
  }
  TORCH_CHECK(t.is_contiguous(), kOp, ": ", name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, kOp, ": ", name,
              " must be 16-byte aligned");
}

}  // namespace

void sage_attention_sm90(const torch::Tensor& q_int8, const torch::Tensor& q_scale,
                         const torch::Tensor& q_kmean, const torch::Tensor& k_int8,
                         const torch::Tensor& k_scale, const torch::Tensor& v_fp8,
                         const torch::Tensor& v_scale,
                         const std::optional<torch::Tensor>& key_lengths, int64_t seq_kv,
                         double scale, torch::Tensor& out,
                         const std::optional<torch::Tensor>& lse, int64_t kv_splits,
                         bool programmatic_launch) {
  TORCH_CHECK(q_int8.is_cuda(), kOp, ": q_int8 must be a CUDA tensor");
  TORCH_CHECK(q_int8.dim() == 4 && k_int8.dim() == 4, kOp,
              ": q_int8 and k_int8 must be 4-D [B, H, S, 128]; got ", q_int8.dim(), "-D and ",
              k_int8.dim(), "-D");
  const int64_t batch = q_int8.size(0), heads = q_int8.size(1), seq_q = q_int8.size(2);
  const int64_t kv_heads = k_int8.size(1), seq_kv_pad = k_int8.size(2);
  TORCH_CHECK(q_int8.size(3) == kSageHeadDim, kOp, ": head_dim must be ", kSageHeadDim,
              "; got ", q_int8.size(3));
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, kOp, ": query heads (", heads,
              ") must be a multiple of key/value heads (", kv_heads, ")");
  TORCH_CHECK(seq_kv_pad % kSageBlockN == 0, kOp, ": k_int8's key count must be padded to a ",
              "multiple of ", kSageBlockN, "; got ", seq_kv_pad);
  TORCH_CHECK(seq_kv >= 0 && seq_kv <= seq_kv_pad && seq_kv_pad - seq_kv < kSageBlockN, kOp,
              ": seq_kv must be in (", seq_kv_pad - kSageBlockN, ", ", seq_kv_pad, "]; got ",
              seq_kv);
  check_tensor(q_int8, "q_int8", at::ScalarType::Char, {batch, heads, seq_q, kSageHeadDim},
               q_int8);
  check_tensor(q_scale, "q_scale", at::ScalarType::Float, {batch, heads, seq_q}, q_int8);
  check_tensor(q_kmean, "q_kmean", at::ScalarType::Float, {batch, heads, seq_q}, q_int8);
  check_tensor(k_int8, "k_int8", at::ScalarType::Char, {batch, kv_heads, seq_kv_pad, kSageHeadDim},
               q_int8);
  check_tensor(k_scale, "k_scale", at::ScalarType::Float,
               {batch, kv_heads, seq_kv_pad / kSageBlockN}, q_int8);
  check_tensor(v_fp8, "v_fp8", at::ScalarType::Float8_e4m3fn,
               {batch, kv_heads, kSageHeadDim, seq_kv_pad}, q_int8);
  check_tensor(v_scale, "v_scale", at::ScalarType::Float,
               {batch, kv_heads, seq_kv_pad / kSageBlockN}, q_int8);
  if (key_lengths.has_value()) {
    check_tensor(*key_lengths, "key_lengths", at::ScalarType::Int, {batch}, q_int8);
  }
  if (lse.has_value()) {
    check_tensor(*lse, "lse", at::ScalarType::Float, {batch, heads, seq_q}, q_int8);
  }
  const auto out_dtype = out.scalar_type();
  TORCH_CHECK(out_dtype == torch::kBFloat16 || out_dtype == torch::kHalf, kOp,
              ": out must be bfloat16 or float16; got ", out_dtype);
  TORCH_CHECK(out.device() == q_int8.device() && out.dim() == 4 && out.size(0) == batch &&
                  out.size(1) == heads && out.size(2) == seq_q && out.size(3) == kSageHeadDim,
              kOp, ": out must be a [B=", batch, ", H=", heads, ", S=", seq_q, ", ", kSageHeadDim,
              "] view on ", q_int8.device());
  // The kernel stores pairs of 16-bit values: 4-byte aligned rows.
  TORCH_CHECK(out.stride(3) == 1 && out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
                  out.stride(2) % 2 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
              kOp, ": out needs a contiguous last dimension, even strides and a 4-byte aligned ",
              "start; got strides (", out.stride(0), ", ", out.stride(1), ", ", out.stride(2), ", ",
              out.stride(3), ")");
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0, kOp, ": scale must be positive and finite; ",
              "got ", scale);
  TORCH_CHECK(kv_splits >= 0 && kv_splits <= omni::attention::kSageMaxSplits, kOp,
              ": kv_splits must be 0 (auto: split the last wave's key ranges where it pays), 1 ",
              "(never) or up to ", omni::attention::kSageMaxSplits, "; got ", kv_splits);
  // TMA coordinates and the 1-D grid are 32-bit.
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  const int64_t m_blocks = (seq_q + 127) / 128;
  TORCH_CHECK(batch * heads * (seq_q + 128) <= kMax32 && batch * kv_heads * seq_kv_pad <= kMax32 &&
                  m_blocks * batch * heads <= kMax32,
              kOp, ": inputs too large for 32-bit TMA coordinates (B*H*S must stay below 2**31)");

  const c10::cuda::CUDAGuard device_guard(q_int8.device());
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major == 9, kOp, ": needs a Hopper GPU (compute capability 9.0, wgmma and ",
              "TMA); ", props->name, " has ", props->major, ".", props->minor);
  if (batch * heads * seq_q == 0) return;
  if (seq_kv_pad == 0) {  // no keys at all: nothing to describe to TMA; rows without keys
    out.zero_();
    if (lse.has_value()) lse->fill_(-std::numeric_limits<float>::infinity());
    return;
  }

  omni::attention::SageSm90Params p{};
  p.q_int8 = q_int8.data_ptr();
  p.k_int8 = k_int8.data_ptr();
  p.v_fp8 = v_fp8.data_ptr();
  p.q_scale = q_scale.data_ptr<float>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.q_kmean = q_kmean.data_ptr<float>();
  p.key_lengths = key_lengths.has_value() ? key_lengths->data_ptr<int32_t>() : nullptr;
  p.out = out.data_ptr();
  p.out_stride_b = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.out_stride_s = out.stride(2);
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.shape = omni::attention::make_sage_shape(batch, heads, kv_heads, seq_q, seq_kv, seq_kv_pad);
  p.scale = static_cast<float>(scale);
  p.qk_scale = static_cast<float>(scale * 1.4426950408889634);
  // The last wave's split: its partials and counters (zeroed) for this call.
  const auto plan = omni::attention::sage_split_plan(
      m_blocks * batch * heads, seq_kv_pad / kSageBlockN, props->multiProcessorCount, kv_splits);
  p.split_first = plan.split_first;
  p.splits = plan.splits;
  torch::Tensor partials, counters;
  if (plan.splits > 1) {
    const int64_t split_blocks = m_blocks * batch * heads - plan.split_first;
    partials = torch::empty({split_blocks * plan.splits * 128 * omni::attention::kSagePartialStride},
                            q_int8.options().dtype(torch::kFloat));
    counters = torch::zeros({split_blocks}, q_int8.options().dtype(torch::kInt));
    p.partials = partials.data_ptr<float>();
    p.counters = counters.data_ptr<int32_t>();
  }
  const auto kind = out_dtype == torch::kBFloat16 ? omni::attention::SageOutKind::kBFloat16
                                                  : omni::attention::SageOutKind::kFloat16;
  const cudaError_t err =
      omni::attention::launch_sage_attention_sm90(p, kind, at::cuda::getCurrentCUDAStream(),
                                                  programmatic_launch);
  TORCH_CHECK(err != cudaErrorNoKernelImageForDevice && err != cudaErrorInvalidDeviceFunction,
              kOp, ": this build of omni_kernels has no sm_90a code for it; rebuild with ",
              "OMNI_CUDA_ARCHS including 90a");
  TORCH_CHECK(err == cudaSuccess, kOp, ": launch failed: ", cudaGetErrorString(err));
}

std::vector<int64_t> sage_attention_sm90_split_plan(int64_t blocks, int64_t kv_blocks, int64_t sms,
                                                    int64_t kv_splits) {
  TORCH_CHECK(blocks >= 0 && kv_blocks >= 0 && sms > 0, "sage_attention_sm90_split_plan: blocks ",
              "and kv_blocks must be >= 0 and sms > 0; got ", blocks, ", ", kv_blocks, ", ", sms);
  const auto plan = omni::attention::sage_split_plan(blocks, kv_blocks, sms, kv_splits);
  return {plan.split_first, plan.splits};
}
