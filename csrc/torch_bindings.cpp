// Schemas and CUDA implementations of omni_kernels._C's ops (torch.ops.omni_kernels.*).
// Fake (meta) implementations live beside the Python wrappers, so torch.compile traces them.
#include <Python.h>

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(omni_kernels, ops) {
  // RMSNorm over each head of q and k (or over all heads), then rotary embedding, in one pass.
  ops.def(
      "qk_rmsnorm_rope(Tensor(a!) q_out, Tensor(b!) k_out, Tensor q, Tensor k, "
      "Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin, float eps, "
      "bool interleaved, bool norm_across_heads) -> ()");
  ops.impl("qk_rmsnorm_rope", torch::kCUDA, &qk_rmsnorm_rope);

  // Per-token FP8/INT8 quantization, optionally fused with RMSNorm/LayerNorm and adaLN.
  ops.def(
      "quantize_per_token(Tensor x, Tensor? norm_weight, Tensor? norm_bias, Tensor? mod_scale, "
      "Tensor? mod_shift, int norm, float eps, float clamp, ScalarType out_dtype) "
      "-> (Tensor, Tensor)");
  ops.impl("quantize_per_token", torch::kCUDA, &quantize_per_token);

  // The same quantization after a GELU, optionally of cat(prefix, GELU(x)) without the cat.
  ops.def(
      "quantize_activated(Tensor x, Tensor? prefix, int activation_from, float clamp, "
      "ScalarType out_dtype) -> (Tensor, Tensor)");
  ops.impl("quantize_activated", torch::kCUDA, &quantize_activated);

  // FP8 W8A8 linear: the per-token quantization above, then an FP8 GEMM with row-wise scales
  // (gemm: "aten" torch._scaled_mm, "cublaslt" or "cublaslt_tuned" fp8_gemm_cublaslt below).
  ops.def(
      "quantized_linear_fp8(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias, float clamp, "
      "bool use_fast_accum, str gemm) -> Tensor");
  ops.impl("quantized_linear_fp8", torch::kCUDA, &quantized_linear_fp8);


#if OMNI_HAS_CUBLASLT_FP8
  // FP8 GEMM with row-wise scales through cuBLASLt, one cached (optionally tuned) plan a problem.
  ops.def(
      "fp8_gemm_cublaslt(Tensor a, Tensor a_scale, Tensor w, Tensor w_scale, Tensor? bias, "
      "ScalarType out_dtype, bool use_fast_accum, bool tune) -> Tensor");
  ops.impl("fp8_gemm_cublaslt", torch::kCUDA, &fp8_gemm_cublaslt);
  ops.def("fp8_gemm_cublaslt_plans() -> str[]", &fp8_gemm_cublaslt_plans);
#endif

#ifndef USE_ROCM
  // Hopper quantized attention (INT8 QK^T, FP8 PV with wgmma) on quantize_qkv's outputs.
  ops.def(
      "sage_attention_sm90(Tensor q_int8, Tensor q_scale, Tensor q_kmean, Tensor k_int8, "
      "Tensor k_scale, Tensor v_fp8, Tensor v_scale, Tensor? key_lengths, int seq_kv, "
      "float scale, Tensor(a!) out, Tensor(b!)? lse, int kv_splits=0, "
      "bool programmatic_launch=False) -> ()");
  ops.impl("sage_attention_sm90", torch::kCUDA, &sage_attention_sm90);
  ops.def("sage_attention_sm90_split_plan(int blocks, int kv_blocks, int sms, int kv_splits) -> int[]",
          &sage_attention_sm90_split_plan);
  // Its inputs' quantization (INT8 Q, smoothed INT8 K, FP8 V^T) in CUDA: two launches, one call.
  ops.def(
      "sage_quantize_qkv(Tensor q, Tensor k, Tensor v, bool bshd, Tensor? key_lengths, "
      "bool permute_v) -> Tensor[]");
  ops.impl("sage_quantize_qkv", torch::kCUDA, &sage_quantize_qkv);
#endif

  // Copy the first/last rows of a feature-map shard into contiguous halo send buffers.
  ops.def("halo_pack(Tensor x, Tensor(a!) send_lo, Tensor(b!) send_hi) -> ()");
  ops.impl("halo_pack", torch::kCUDA, &halo_pack);

  // Write a shard and its halo rows (received, zero or replicated) into a pre-padded buffer.
  ops.def(
      "halo_assemble(Tensor x, Tensor? recv_lo, Tensor? recv_hi, Tensor(a!) out, int lo_rows, "
      "int hi_rows, int lo_mode, int hi_mode) -> ()");
  ops.impl("halo_assemble", torch::kCUDA, &halo_assemble);
}

// `import omni_kernels._C` loads this library (and so runs TORCH_LIBRARY above); the module
// itself carries no Python functions: every op is reached through torch.ops.omni_kernels.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr};
  return PyModule_Create(&module_def);
}
