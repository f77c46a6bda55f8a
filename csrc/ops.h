// Host entry points of omni_kernels._C, one per op registered in torch_bindings.cpp.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <torch/all.h>

#ifndef USE_ROCM
#include <cublas_api.h>
#endif
// cuBLASLt's FP8 GEMM with outer-vector (row-wise) scales arrived in cuBLAS 12.9: older toolkits
// build the extension without fp8_gemm_cublaslt (its op is then not registered).
#if !defined(USE_ROCM) && defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
#define OMNI_HAS_CUBLASLT_FP8 1
#else
#define OMNI_HAS_CUBLASLT_FP8 0
#endif

// Fused QK-RMSNorm + rotary embedding (csrc/qk_norm_rope/). Writes q_out and k_out.
void qk_rmsnorm_rope(torch::Tensor& q_out, torch::Tensor& k_out, const torch::Tensor& q,
                     const torch::Tensor& k, const std::optional<torch::Tensor>& q_weight,
                     const std::optional<torch::Tensor>& k_weight, const torch::Tensor& cos,
                     const torch::Tensor& sin, double eps, bool interleaved,
                     bool norm_across_heads);

// Per-token quantization to FP8 e4m3 / INT8, optionally after RMSNorm or LayerNorm and adaLN
// modulation (csrc/quant/). Returns (q [M, K], scale [M, 1] float32).
std::tuple<torch::Tensor, torch::Tensor> quantize_per_token(
    const torch::Tensor& x, const std::optional<torch::Tensor>& norm_weight,
    const std::optional<torch::Tensor>& norm_bias, const std::optional<torch::Tensor>& mod_scale,
    const std::optional<torch::Tensor>& mod_shift, int64_t norm, double eps, double clamp,
    at::ScalarType out_dtype);

// GELU (tanh approximation) on x's columns activation_from.. (all of x with a prefix), then
// per-token quantization of the row cat(prefix, activated x) (csrc/quant/); x [M, K] and prefix
// [M, K0] fp16/bf16 with 16-byte aligned rows. Returns (q [M, K0 + K], scale [M, 1] float32).
std::tuple<torch::Tensor, torch::Tensor> quantize_activated(
    const torch::Tensor& x, const std::optional<torch::Tensor>& prefix, int64_t activation_from,
    double clamp, at::ScalarType out_dtype);

// An FP8 W8A8 linear layer in one call: per-token FP8 quantization of x [M, K] (fp16/bf16,
// 16-byte aligned rows; clamp <= 0: none) with quantize_per_token's kernel, then
// an FP8 GEMM with row-wise scales: out [M, N] = (q * scale) @ (w_q * w_scale)^T + bias in
// x's dtype. w_q [N, K] float8_e4m3fn row-major, w_scale [N] float32, bias [N] in x's dtype or
// none. gemm: "aten" (torch._scaled_mm), "cublaslt" (fp8_gemm_cublaslt's cached plan, untuned:
// the heuristic's choice, or whatever an earlier tuned call chose) or "cublaslt_tuned" (the plan
// tuned on first use). For eager calls: one dispatched op where the Python path makes two.
torch::Tensor quantized_linear_fp8(const torch::Tensor& x, const torch::Tensor& w_q,
                                   const torch::Tensor& w_scale,
                                   const std::optional<torch::Tensor>& bias, double clamp,
                                   bool use_fast_accum, c10::string_view gemm);

#if OMNI_HAS_CUBLASLT_FP8
// FP8 GEMM with row-wise scales through cuBLASLt (csrc/quant/fp8_gemm_cublaslt.cpp), with one
// cached plan (descriptors, algorithm) per problem: out [M, N] = (a * a_scale[:, None]) @
// (w * w_scale[:, None])^T + bias in out_dtype (bfloat16 or float16). a [M, K] and w [N, K]
// float8_e4m3fn, K and N multiples of 16; a_scale [M] and w_scale [N] float32 (any shape with
// that many values); bias [N] in out_dtype or none. Operands that are not contiguous and 16-byte
// aligned are copied first.
// tune: the plan's first call outside stream capture times cuBLASLt's heuristic candidates and
// the configurations it accepts (within a GPU-time budget) and keeps the fastest (it
// synchronizes the stream once).
torch::Tensor fp8_gemm_cublaslt(const torch::Tensor& a, const torch::Tensor& a_scale,
                                const torch::Tensor& w, const torch::Tensor& w_scale,
                                const std::optional<torch::Tensor>& bias, at::ScalarType out_dtype,
                                bool use_fast_accum, bool tune);
// One line per cached fp8_gemm_cublaslt plan: the problem, the algorithm and how it was chosen.
std::vector<std::string> fp8_gemm_cublaslt_plans();
#endif

// Quantized attention on Hopper (csrc/attention/, CUDA only): softmax(scale * q k^T) v from the
// quantized inputs of omni_kernels.attention.quantized (INT8 Q and smoothed K, FP8 V^T with its
// keys permuted in groups of 16), head_dim 128. Writes out [B, Hq, Sq, 128] (a view with any
// even strides, unit last) and, if given, lse [B, Hq, Sq] float32 (natural log, K's mean added
// back). Keys >= key_lengths[b] (int32 [B], optional) and >= seq_kv are masked. kv_splits: the
// last wave's query blocks are cut into kv_splits key ranges (1: never, 2..8: forced, 0: the
// plan of attention/sage_sm90_params.h, sage_split_plan), merged in the kernel.
// programmatic_launch: launch as a programmatic dependent (PDL) of the stream's previous kernel
// (the quantizer's): the CTAs set up while it finishes and wait for it before any global read.
void sage_attention_sm90(const torch::Tensor& q_int8, const torch::Tensor& q_scale,
                         const torch::Tensor& q_kmean, const torch::Tensor& k_int8,
                         const torch::Tensor& k_scale, const torch::Tensor& v_fp8,
                         const torch::Tensor& v_scale,
                         const std::optional<torch::Tensor>& key_lengths, int64_t seq_kv,
                         double scale, torch::Tensor& out,
                         const std::optional<torch::Tensor>& lse, int64_t kv_splits,
                         bool programmatic_launch);
// sage_attention_sm90's plan for a grid of `blocks` query blocks over `kv_blocks` key blocks on
// `sms` SMs: [split_first, splits] (attention/sage_sm90_params.h, sage_split_plan).
std::vector<int64_t> sage_attention_sm90_split_plan(int64_t blocks, int64_t kv_blocks, int64_t sms,
                                                    int64_t kv_splits);

// Q/K/V quantization for sage_attention_sm90 (csrc/attention/sage_quant.cu): q [B, Hq, Sq, 128],
// k/v [B, Hkv, Skv, 128] (bshd: [B, S, H, 128]) fp16/bf16 read through strides. Returns
// QuantizedQKV's tensors: q_int8, q_scale, q_kmean, k_int8 (keys padded to a multiple of 128),
// k_scale, k_mean, v_fp8 ([B, Hkv, 128, Skv_pad], keys permuted in groups of 16 if permute_v),
// v_scale.
std::vector<torch::Tensor> sage_quantize_qkv(const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, bool bshd,
                                             const std::optional<torch::Tensor>& key_lengths,
                                             bool permute_v);

// Halo rows of a height-sharded feature map (csrc/halo/): pack the first/last rows of x
// [N, T, h, W] into contiguous send buffers; assemble x and its halo rows (received, zero or
// replicated) into out [N, T, lo + h + hi, W] (any strides).
void halo_pack(const torch::Tensor& x, torch::Tensor& send_lo, torch::Tensor& send_hi);
void halo_assemble(const torch::Tensor& x, const std::optional<torch::Tensor>& recv_lo,
                   const std::optional<torch::Tensor>& recv_hi, torch::Tensor& out,
                   int64_t lo_rows, int64_t hi_rows, int64_t lo_mode, int64_t hi_mode);
