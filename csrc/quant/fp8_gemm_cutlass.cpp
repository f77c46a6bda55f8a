// omni_kernels::fp8_gemm_cutlass: argument checks, workspace and launch of the CUTLASS FP8
// GEMM with row-wise scales (fp8_gemm_cutlass.cu).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <string>

#include "fp8_gemm_cutlass.h"
#include "fp8_gemm_operands.h"
#include "ops.h"

#if OMNI_HAS_CUTLASS_FP8
namespace omni::quant {
namespace {

constexpr const char* kCutlassOp = "fp8_gemm_cutlass";

struct Schedule {
  CutlassDecomposition decomposition;
  int splits;
  CutlassCluster cluster;
};

// "<decomposition>-<cluster>": decomposition streamk, data_parallel, heuristic (CUTLASS's choice
// among the three) or splitk2/splitk3/splitk4; cluster 1x1 or 2x1.
Schedule parse_schedule(c10::string_view text) {
  const std::string s(text);
  const auto dash = s.rfind('-');
  const std::string decomposition = dash == std::string::npos ? s : s.substr(0, dash);
  const std::string cluster = dash == std::string::npos ? "" : s.substr(dash + 1);
  Schedule out{CutlassDecomposition::kHeuristic, 1, CutlassCluster::k1x1};
  bool ok = cluster == "1x1" || cluster == "2x1";
  out.cluster = cluster == "2x1" ? CutlassCluster::k2x1 : CutlassCluster::k1x1;
  if (decomposition == "streamk") {
    out.decomposition = CutlassDecomposition::kStreamK;
  } else if (decomposition == "data_parallel") {
    out.decomposition = CutlassDecomposition::kDataParallel;
  } else if (decomposition == "heuristic") {
    out.decomposition = CutlassDecomposition::kHeuristic;
  } else if (decomposition.size() == 7 && decomposition.rfind("splitk", 0) == 0 &&
             decomposition[6] >= '2' && decomposition[6] <= '4') {
    out.decomposition = CutlassDecomposition::kSplitK;
    out.splits = decomposition[6] - '0';
  } else {
    ok = false;
  }
  TORCH_CHECK(ok, kCutlassOp, ": schedule must be '<decomposition>-<cluster>' with decomposition "
              "streamk, data_parallel, heuristic, splitk2, splitk3 or splitk4 and cluster 1x1 or "
              "2x1; got '", s, "'");
  return out;
}

}  // namespace
}  // namespace omni::quant

torch::Tensor fp8_gemm_cutlass(const torch::Tensor& a_in, const torch::Tensor& a_scale_in,
                               const torch::Tensor& w_in, const torch::Tensor& w_scale_in,
                               const std::optional<torch::Tensor>& bias_in,
                               at::ScalarType out_dtype, c10::string_view schedule) {
  using namespace omni::quant;
  const Schedule parsed = parse_schedule(schedule);
  TORCH_CHECK(a_in.is_cuda(), kCutlassOp, ": a must be a CUDA tensor; got one on ", a_in.device());
  TORCH_CHECK(a_in.dim() == 2 && w_in.dim() == 2, kCutlassOp,
              ": a [M, K] and w [N, K] must be 2-D; got ", a_in.sizes(), " and ", w_in.sizes());
  const int64_t m = a_in.size(0), k = a_in.size(1), n = w_in.size(0);
  TORCH_CHECK(out_dtype == at::kBFloat16, kCutlassOp,
              ": out_dtype must be bfloat16 (the one instantiated output); got ", out_dtype);
  TORCH_CHECK(k > 0 && n > 0 && k % kFp8GemmAlignBytes == 0 && n % kFp8GemmAlignBytes == 0,
              kCutlassOp, ": K and N must be positive multiples of ", kFp8GemmAlignBytes,
              "; got K=", k, ", N=", n);
  TORCH_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX, kCutlassOp,
              ": M, N and K must fit in 32 bits; got ", m, ", ", n, ", ", k);
  const torch::Tensor a = checked_fp8_operand(kCutlassOp, a_in, "a", m, k, a_in);
  const torch::Tensor w = checked_fp8_operand(kCutlassOp, w_in, "w", n, k, a_in);
  const torch::Tensor a_scale =
      checked_gemm_vector(kCutlassOp, a_scale_in, "a_scale", at::kFloat, m, a_in);
  const torch::Tensor w_scale =
      checked_gemm_vector(kCutlassOp, w_scale_in, "w_scale", at::kFloat, n, a_in);
  std::optional<torch::Tensor> bias;
  if (bias_in.has_value()) {
    bias = checked_gemm_vector(kCutlassOp, *bias_in, "bias", out_dtype, n, a_in);
  }

  const c10::cuda::CUDAGuard device_guard(a.device());
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major == 9 && props->minor == 0, kCutlassOp,
              ": needs a Hopper GPU (compute capability 9.0: the kernel is built for sm_90a only); "
              "got ", props->major, ".", props->minor, " (", props->name, ")");
  auto out = torch::empty({m, n}, a.options().dtype(out_dtype));
  if (m == 0) return out;

  CutlassFp8GemmProblem problem;
  problem.m = m;
  problem.n = n;
  problem.k = k;
  problem.a = a.data_ptr();
  problem.lda = k;
  problem.w = w.data_ptr();
  problem.ldw = k;
  problem.a_scale = a_scale.data_ptr<float>();
  problem.w_scale = w_scale.data_ptr<float>();
  problem.bias = bias ? bias->data_ptr() : nullptr;
  problem.out = out.data_ptr();
  problem.ldo = n;
  problem.device = a.get_device();
  problem.sm_count = props->multiProcessorCount;
  problem.decomposition = parsed.decomposition;
  problem.splits = parsed.splits;
  problem.cluster = parsed.cluster;

  size_t workspace_bytes = 0;
  const std::string reason = cutlass_fp8_gemm_workspace(problem, &workspace_bytes);
  TORCH_CHECK(reason.empty(), kCutlassOp, ": ", reason, " (M=", m, ", N=", n, ", K=", k, ")");
  // Stream-K's partial tiles and locks: the caching allocator makes this cheap per call.
  torch::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = torch::empty({static_cast<int64_t>(workspace_bytes)}, a.options().dtype(at::kByte));
  }
  const std::string failure = cutlass_fp8_gemm_run(
      problem, workspace_bytes > 0 ? workspace.data_ptr() : nullptr,
      at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(failure.empty(), kCutlassOp, ": ", failure, " (M=", m, ", N=", n, ", K=", k, ")");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
#endif
