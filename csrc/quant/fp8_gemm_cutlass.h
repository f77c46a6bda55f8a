// FP8 W8A8 GEMM with row-wise scales, built from CUTLASS's Hopper (sm_90a) collectives with a
// stream-K tile scheduler: the host-visible problem description and launcher.
//
// Why a second FP8 GEMM next to cuBLASLt's (fp8_gemm_cublaslt.cpp): cuBLASLt's Hopper FP8
// kernels are persistent but data-parallel, one 128x128 output tile per work unit. At Flux's
// MLP down projection (4608 x 12288 -> 3072) that is 864 tiles on 132 SMs: 6.55 waves run as
// 7, and the last wave leaves 60 SMs idle. Stream-K splits the leftover tiles' K loop across
// all SMs instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace omni {
namespace quant {

// How the stream-K scheduler splits the problem (CUTLASS's DecompositionMode).
enum class CutlassDecomposition : int { kHeuristic = 0, kDataParallel = 1, kStreamK = 2, kSplitK = 3 };

// Thread-block cluster of the instantiated kernels: 1x1 or 2 CTAs along M sharing each B tile.
enum class CutlassCluster : int { k1x1 = 0, k2x1 = 1 };

// out[m, n] = bf16(a_scale[m] * w_scale[n] * sum_k a[m, k] w[n, k] + bias[n]), accumulated in
// float32 with the FP8 tensor cores' partial sums promoted to float32 every 4 MMAs (the
// precise mode; no fast accumulation).
//
// Layouts: a [M, K] float8_e4m3fn with row stride lda (elements, unit column stride); w [N, K]
// float8_e4m3fn with row stride ldw; a_scale [M] and w_scale [N] float32 contiguous; bias [N]
// bfloat16 contiguous or nullptr; out [M, N] bfloat16 with row stride ldo. TMA needs a, w and
// out 16-byte aligned with 16-byte-multiple row strides, and K a multiple of 16, N of 8.
struct CutlassFp8GemmProblem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* w = nullptr;
  int64_t ldw = 0;
  const float* a_scale = nullptr;
  const float* w_scale = nullptr;
  const void* bias = nullptr;
  void* out = nullptr;
  int64_t ldo = 0;
  int device = 0;
  int sm_count = 0;
  CutlassDecomposition decomposition = CutlassDecomposition::kHeuristic;
  int splits = 1;  // split-K factor, only with kSplitK
  CutlassCluster cluster = CutlassCluster::k1x1;
};

// Bytes of global workspace the problem needs (stream-K partial tiles and their locks); the
// caller allocates it (zero bytes: pass nullptr). An empty string on success, else why the
// problem cannot run.
std::string cutlass_fp8_gemm_workspace(const CutlassFp8GemmProblem& problem, size_t* bytes);

// Runs the GEMM on `stream`; `workspace` holds at least the bytes above. An empty string on
// success, else CUTLASS's reason (nothing was launched).
std::string cutlass_fp8_gemm_run(const CutlassFp8GemmProblem& problem, void* workspace,
                                 cudaStream_t stream);

}  // namespace quant
}  // namespace omni
