// Host entry of the CUDA Q/K/V quantization for the Hopper quantized attention kernel
// (sage_quant.cu): argument checks, allocation, the two launches.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <limits>

#include "../ops.h"
#include "sage_quant_params.h"

namespace {

constexpr const char* kOp = "sage_quantize_qkv";
constexpr int64_t kHeadDim = 128;
constexpr int64_t kBlock = 128;

// [B, H, S, D] view of a bhsd or bshd tensor.
torch::Tensor bhsd_view(const torch::Tensor& t, bool bshd) { return bshd ? t.transpose(1, 2) : t; }

void check_input(const torch::Tensor& t, const char* name, const torch::Tensor& q) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device(), kOp, ": ", name, " must be on ", q.device(),
              "; got ", t.device());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), kOp, ": ", name, " must have q's dtype ",
              q.scalar_type(), "; got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 4 && t.size(3) == kHeadDim, kOp, ": ", name, " must be 4-D with head_dim ",
              kHeadDim, "; got ", t.dim(), "-D with last size ", t.dim() ? t.size(-1) : 0);
  // The kernels load 4 values (8 bytes) a thread.
  TORCH_CHECK(t.stride(3) == 1 && t.stride(0) % 4 == 0 && t.stride(1) % 4 == 0 &&
                  t.stride(2) % 4 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 8 == 0,
              kOp, ": ", name, " needs a contiguous last dimension, strides that are multiples ",
              "of 4 and an 8-byte aligned start; got strides (", t.stride(0), ", ", t.stride(1),
              ", ", t.stride(2), ", ", t.stride(3), ")");
}

}  // namespace

std::vector<torch::Tensor> sage_quantize_qkv(const torch::Tensor& q_in, const torch::Tensor& k_in,
                                             const torch::Tensor& v_in, bool bshd,
                                             const std::optional<torch::Tensor>& key_lengths,
                                             bool permute_v) {
  TORCH_CHECK(q_in.is_cuda(), kOp, ": q must be a CUDA tensor");
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kHalf, kOp,
              ": q, k, v must be bfloat16 or float16; got ", dtype);
  check_input(q_in, "q", q_in);
  check_input(k_in, "k", q_in);
  check_input(v_in, "v", q_in);
  const torch::Tensor q = bhsd_view(q_in, bshd), k = bhsd_view(k_in, bshd), v = bhsd_view(v_in, bshd);
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2);
  const int64_t kv_heads = k.size(1), seq_kv = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && v.size(1) == kv_heads &&
                  v.size(2) == seq_kv,
              kOp, ": k and v must be [B=", batch, ", Hkv, Skv, 128] alike; got ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, kOp, ": query heads (", heads,
              ") must be a multiple of key/value heads (", kv_heads, ")");
  if (key_lengths.has_value()) {
    TORCH_CHECK(key_lengths->device() == q.device() && key_lengths->scalar_type() == torch::kInt &&
                    key_lengths->dim() == 1 && key_lengths->size(0) == batch &&
                    key_lengths->is_contiguous(),
                kOp, ": key_lengths must be a contiguous int32 [B=", batch, "] on ", q.device());
  }
  const int64_t blocks = (seq_kv + kBlock - 1) / kBlock;
  const int64_t seq_kv_pad = blocks * kBlock;
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(batch * heads * seq_q <= kMax32 && batch * kv_heads * seq_kv_pad <= kMax32, kOp,
              ": inputs too large (B*H*S must stay below 2**31)");

  const c10::cuda::CUDAGuard device_guard(q.device());
  const auto options = q.options();
  const auto f32 = options.dtype(torch::kFloat32);
  auto q_int8 = torch::empty({batch, heads, seq_q, kHeadDim}, options.dtype(torch::kChar));
  auto q_scale = torch::empty({batch, heads, seq_q}, f32);
  auto q_kmean = torch::empty({batch, heads, seq_q}, f32);
  auto k_int8 = torch::empty({batch, kv_heads, seq_kv_pad, kHeadDim}, options.dtype(torch::kChar));
  auto k_scale = torch::empty({batch, kv_heads, blocks}, f32);
  // written by the first launch (K's sample mean), read by the second
  auto k_mean = torch::empty({batch, kv_heads, kHeadDim}, f32);
  auto v_fp8 = torch::empty({batch, kv_heads, kHeadDim, seq_kv_pad},
                            options.dtype(at::ScalarType::Float8_e4m3fn));
  auto v_scale = torch::empty({batch, kv_heads, blocks}, f32);  // one per key block

  omni::attention::SageQuantParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_sb = q.stride(0); p.q_sh = q.stride(1); p.q_ss = q.stride(2);
  p.k_sb = k.stride(0); p.k_sh = k.stride(1); p.k_ss = k.stride(2);
  p.v_sb = v.stride(0); p.v_sh = v.stride(1); p.v_ss = v.stride(2);
  p.key_lengths = key_lengths.has_value() ? key_lengths->data_ptr<int32_t>() : nullptr;
  p.shape = omni::attention::make_sage_shape(batch, heads, kv_heads, seq_q, seq_kv, seq_kv_pad);
  p.permute_v = permute_v;
  p.q_int8 = q_int8.data_ptr<int8_t>();
  p.q_scale = q_scale.data_ptr<float>();
  p.q_kmean = q_kmean.data_ptr<float>();
  p.k_int8 = k_int8.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.k_mean = k_mean.data_ptr<float>();
  p.v_fp8 = static_cast<uint8_t*>(v_fp8.data_ptr());
  p.v_scale = v_scale.data_ptr<float>();
  const cudaError_t err = omni::attention::launch_sage_quantize(
      p, dtype == torch::kBFloat16, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, kOp, ": launch failed: ", cudaGetErrorString(err));
  return {q_int8, q_scale, q_kmean, k_int8, k_scale, k_mean, v_fp8, v_scale};
}
