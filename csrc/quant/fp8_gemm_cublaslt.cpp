// FP8 W8A8 GEMM with row-wise scales through cuBLASLt, planned once per problem.
//
// torch._scaled_mm builds its cuBLASLt descriptors and asks the heuristic for one algorithm
// on every call, and runs whatever the heuristic ranks first. This op keeps one plan per
// (device, M, N, K, output dtype, bias, accumulation): descriptors, layouts and the chosen
// algorithm. With tune=true the plan's first call outside stream capture times the
// heuristic's candidates on the call's own operands and keeps the fastest: at shapes whose
// tile count sits just above a multiple of the SM count (Flux's 4608 x 12288 -> 3072 on 132
// SMs) the top-ranked tile is not always the fastest.
//
// Operands (row-major, as torch holds them): a [M, K] and w [N, K] float8_e4m3fn, a_scale [M]
// and w_scale [N] float32, bias [N] in the output dtype. cuBLASLt is column-major, so the
// product is computed transposed: D^T [N, M] = op_T(w as K x N) * (a as K x M), which is the
// "TN" layout Hopper's FP8 kernels require; D^T column-major is out [M, N] row-major. With the
// outer-vector scale mode cuBLASLt multiplies element (i, j) of D^T by w_scale[i] * a_scale[j].
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/all.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops.h"

#if OMNI_HAS_CUBLASLT_FP8
namespace omni::quant {
namespace {

constexpr const char* kOp = "fp8_gemm_cublaslt";
// A tuned plan's candidates: cuBLASLt's heuristic ones (for these FP8 problems often just one)
// and the configurations enumerated here (tile x stages x cluster x split-K of
// each algorithm id, those cublasLtMatmulAlgoCheck accepts), at most kTuneCandidates in all.
// Pass 1 times each once (after one warm-up run), in that order, until kTuneBudgetUs of GPU
// time is spent; pass 2 re-times the kTuneFinalists fastest and the heuristic's first over
// kTuneRuns runs and keeps the fastest median. The enumeration pays off at small M, where a run
// is short and the budget reaches far; at large M the budget stops it after a few dozen, so a
// plan costs well under a second once instead of seconds.
constexpr int kHeuristicCandidates = 8;
constexpr size_t kTuneCandidates = 384;
constexpr size_t kTuneFinalists = 6;
constexpr int kTuneRuns = 5;
constexpr float kTuneBudgetUs = 250000.f;
constexpr int kMaxAlgoIds = 64;
// Split-K factors tried (1 first: without a reduction pass), and thread-block cluster shapes
// (Hopper: the multicast of a shared operand across 2 CTAs pays at these sizes or not).
constexpr std::array<int32_t, 4> kSplitK = {1, 2, 3, 4};
constexpr std::array<uint16_t, 3> kClusterShapes = {CUBLASLT_CLUSTER_SHAPE_1x1x1,
                                                    CUBLASLT_CLUSTER_SHAPE_2x1x1,
                                                    CUBLASLT_CLUSTER_SHAPE_1x2x1};
// cuBLASLt's FP8 kernels need 16-byte aligned operands and leading dimensions; operands that
// are all 256-byte aligned (fresh allocations) may take algorithms that need that.
constexpr int64_t kAlignBytes = 16;
constexpr int64_t kWideAlignBytes = 256;

#define OMNI_CUBLASLT_CHECK(expr, what)                                                    \
  do {                                                                                     \
    const cublasStatus_t omni_status_ = (expr);                                            \
    TORCH_CHECK(omni_status_ == CUBLAS_STATUS_SUCCESS, kOp, ": ", what, " failed: ",       \
                cublasLtGetStatusName(omni_status_), " (", cublasLtGetStatusString(omni_status_), \
                "; cuBLASLt ", cublasLtGetVersion(), ")");                                 \
  } while (0)

struct PlanKey {
  int device;
  int64_t m, n, k;
  at::ScalarType out_dtype;
  bool bias;
  bool fast_accum;
  // The operands' common pointer alignment (kAlignBytes or kWideAlignBytes): an algorithm
  // chosen for 256-byte aligned operands may not run on 16-byte aligned ones.
  uint32_t alignment;
  bool operator==(const PlanKey& o) const {
    return device == o.device && m == o.m && n == o.n && k == o.k && out_dtype == o.out_dtype &&
           bias == o.bias && fast_accum == o.fast_accum && alignment == o.alignment;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = std::hash<int64_t>()(key.m);
    for (int64_t part : {key.n, key.k, static_cast<int64_t>(key.device),
                         static_cast<int64_t>(key.out_dtype),
                         static_cast<int64_t>(key.bias) * 2 + key.fast_accum,
                         static_cast<int64_t>(key.alignment)}) {
      h = h * 1000003u ^ std::hash<int64_t>()(part);
    }
    return h;
  }
};

// The descriptors of one problem and the algorithm it runs; owned by the plan cache.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w_layout = nullptr, a_layout = nullptr, out_layout = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t algo_workspace = 0;
  bool tuned = false;
  int candidates = 0;         // candidates found (the heuristic's, and enumerated ones when tuned)
  int timed_candidates = 0;   // those pass 1 timed within the budget (tuned plans)
  int chosen_rank = 0;        // the chosen algorithm's rank in the heuristic's list
  float chosen_us = 0.f;      // its median time (tuned plans)
  float heuristic_us = 0.f;   // the heuristic's first choice's median time (tuned plans)
  ~Plan() {
    if (out_layout) cublasLtMatrixLayoutDestroy(out_layout);
    if (a_layout) cublasLtMatrixLayoutDestroy(a_layout);
    if (w_layout) cublasLtMatrixLayoutDestroy(w_layout);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct PlanCache {
  std::mutex mutex;  // held over the descriptor's per-call pointers and the enqueue
  std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> plans;
};

PlanCache& plan_cache() {
  // Never destroyed: descriptors are not torn down at exit, after cuBLASLt may be unloaded.
  static PlanCache* cache = new PlanCache;
  return *cache;
}

template <typename T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value,
              const char* what) {
  OMNI_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), what);
}

cudaDataType_t cuda_type(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
}

std::unique_ptr<Plan> make_plan(const PlanKey& key) {
  auto plan = std::make_unique<Plan>();
  OMNI_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                      "cublasLtMatmulDescCreate");
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(CUBLAS_OP_T), "TRANSA");
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(CUBLAS_OP_N), "TRANSB");
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(key.fast_accum),
           "FAST_ACCUM");
  const auto outer_vector = static_cast<int32_t>(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, outer_vector,
           "A_SCALE_MODE (outer-vector, row-wise scales)");
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, outer_vector,
           "B_SCALE_MODE (outer-vector, row-wise scales)");
  if (key.bias) {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(CUBLASLT_EPILOGUE_BIAS),
             "EPILOGUE (bias)");
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
             static_cast<int32_t>(cuda_type(key.out_dtype)), "BIAS_DATA_TYPE");
  }
  OMNI_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->w_layout, CUDA_R_8F_E4M3, key.k, key.n, key.k),
                      "the weight's layout");
  OMNI_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->a_layout, CUDA_R_8F_E4M3, key.k, key.m, key.k),
                      "the activation's layout");
  OMNI_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&plan->out_layout, cuda_type(key.out_dtype), key.n, key.m, key.n),
      "the output's layout");
  return plan;
}

// The heuristic's candidates for the plan's problem that fit the workspace, best-ranked first.
std::vector<cublasLtMatmulHeuristicResult_t> candidates(cublasLtHandle_t handle, const Plan& plan,
                                                        size_t workspace, uint32_t alignment,
                                                        int count) {
  cublasLtMatmulPreference_t preference = nullptr;
  OMNI_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
  const uint64_t max_workspace = workspace;
  cublasStatus_t set_status = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace));
  for (auto attribute : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                         CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (set_status == CUBLAS_STATUS_SUCCESS) {
      set_status = cublasLtMatmulPreferenceSetAttribute(preference, attribute, &alignment, sizeof(alignment));
    }
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(count);
  int returned = 0;
  const cublasStatus_t status =
      set_status != CUBLAS_STATUS_SUCCESS
          ? set_status
          : cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.w_layout, plan.a_layout,
                                           plan.out_layout, plan.out_layout, preference, count,
                                           results.data(), &returned);
  cublasLtMatmulPreferenceDestroy(preference);
  OMNI_CUBLASLT_CHECK(status,
                      "cublasLtMatmulAlgoGetHeuristic (an FP8 GEMM with outer-vector scales needs "
                      "cuBLAS >= 12.9 and compute capability 9.0 or 8.9)");
  results.resize(std::max(returned, 0));
  std::erase_if(results, [&](const cublasLtMatmulHeuristicResult_t& r) {
    return r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > workspace;
  });
  TORCH_CHECK(!results.empty(), kOp, ": cuBLASLt ", cublasLtGetVersion(),
              " offers no FP8 GEMM with row-wise scales for this problem on this GPU");
  return results;
}

struct Operands {
  const void* w;
  const void* a;
  void* out;
  void* workspace;
  size_t workspace_size;
  cudaStream_t stream;
};

cublasStatus_t run(cublasLtHandle_t handle, const Plan& plan, const cublasLtMatmulAlgo_t& algo,
                   const Operands& ops) {
  const float alpha = 1.f, beta = 0.f;
  return cublasLtMatmul(handle, plan.desc, &alpha, ops.w, plan.w_layout, ops.a, plan.a_layout, &beta,
                        ops.out, plan.out_layout, ops.out, plan.out_layout, &algo, ops.workspace,
                        ops.workspace_size, ops.stream);
}

// CUDA events, destroyed with the object (also when a check throws).
struct Events {
  std::vector<cudaEvent_t> events;
  explicit Events(int count) : events(count, nullptr) {
    for (auto& event : events) C10_CUDA_CHECK(cudaEventCreate(&event));
  }
  ~Events() {
    for (auto event : events) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }
};

// Median time (us) of `runs` runs of `algo` after `warmup`, or a negative value if it fails.
float time_algo(cublasLtHandle_t handle, const Plan& plan, const cublasLtMatmulAlgo_t& algo,
                const Operands& ops, int warmup, int runs) {
  bool ok = true;
  for (int i = 0; i < warmup && ok; ++i) ok = run(handle, plan, algo, ops) == CUBLAS_STATUS_SUCCESS;
  Events timing(runs + 1);
  C10_CUDA_CHECK(cudaEventRecord(timing.events[0], ops.stream));
  for (int i = 0; i < runs; ++i) {
    if (ok) ok = run(handle, plan, algo, ops) == CUBLAS_STATUS_SUCCESS;
    C10_CUDA_CHECK(cudaEventRecord(timing.events[i + 1], ops.stream));  // every event recorded
  }
  C10_CUDA_CHECK(cudaEventSynchronize(timing.events[runs]));
  if (!ok) {
    (void)cudaGetLastError();  // a refused launch must not surface in a later, unrelated check
    return -1.f;
  }
  std::vector<float> times(runs);
  for (int i = 0; i < runs; ++i) {
    C10_CUDA_CHECK(cudaEventElapsedTime(&times[i], timing.events[i], timing.events[i + 1]));
  }
  std::nth_element(times.begin(), times.begin() + runs / 2, times.end());
  return times[runs / 2] * 1000.f;
}

template <typename T>
std::vector<T> algo_caps(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attribute) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS ||
      bytes < sizeof(T)) {
    return {};
  }
  std::vector<T> values(bytes / sizeof(T));
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, values.data(), values.size() * sizeof(T),
                                        &bytes) != CUBLAS_STATUS_SUCCESS) {
    return {};
  }
  return values;
}

template <typename T>
bool set_config(cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute, T value) {
  return cublasLtMatmulAlgoConfigSetAttribute(&algo, attribute, &value, sizeof(value)) ==
         CUBLAS_STATUS_SUCCESS;
}

// The split-K reduction an algorithm offers, float32 partial sums first; NONE if it offers none.
uint32_t reduction_scheme(const cublasLtMatmulAlgo_t& algo) {
  const auto mask = algo_caps<uint32_t>(algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
  if (mask.empty()) return CUBLASLT_REDUCTION_SCHEME_NONE;
  for (uint32_t scheme : {CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, CUBLASLT_REDUCTION_SCHEME_INPLACE,
                          CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE}) {
    if (mask[0] & scheme) return scheme;
  }
  return CUBLASLT_REDUCTION_SCHEME_NONE;
}

// Configurations of every FP8 algorithm id that cuBLASLt accepts for the plan's problem, split-K
// 1 first, each with the workspace it needs (which must fit `workspace`), up to `limit`.
// Whether `algo` runs on operands aligned to `alignment` bytes.
bool takes_alignment(const cublasLtMatmulAlgo_t& algo, uint32_t alignment) {
  for (auto attribute : {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES,
                         CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES}) {
    const auto needed = algo_caps<uint32_t>(algo, attribute);
    if (!needed.empty() && needed[0] > alignment) return false;
  }
  return true;
}

std::vector<cublasLtMatmulHeuristicResult_t> enumerated(cublasLtHandle_t handle, const Plan& plan,
                                                        const PlanKey& key, size_t workspace,
                                                        size_t limit) {
  const cudaDataType_t out_type = cuda_type(key.out_dtype);
  std::array<int, kMaxAlgoIds> ids{};
  int id_count = 0;
  if (cublasLtMatmulAlgoGetIds(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3,
                               out_type, out_type, kMaxAlgoIds, ids.data(), &id_count) !=
      CUBLAS_STATUS_SUCCESS) {
    return {};
  }
  std::vector<cublasLtMatmulHeuristicResult_t> found;
  for (int32_t split_k : kSplitK) {
    for (int i = 0; i < std::min(id_count, kMaxAlgoIds); ++i) {
      cublasLtMatmulAlgo_t base{};
      if (cublasLtMatmulAlgoInit(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3,
                                 CUDA_R_8F_E4M3, out_type, out_type, ids[i], &base) !=
          CUBLAS_STATUS_SUCCESS ||
          !takes_alignment(base, key.alignment)) {
        continue;
      }
      uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
      if (split_k > 1) {
        const auto split_support = algo_caps<int32_t>(base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT);
        scheme = reduction_scheme(base);
        if (split_support.empty() || !split_support[0] || scheme == CUBLASLT_REDUCTION_SCHEME_NONE) {
          continue;
        }
      }
      auto tiles = algo_caps<uint32_t>(base, CUBLASLT_ALGO_CAP_TILE_IDS);
      auto stages = algo_caps<uint32_t>(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
      if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
      if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
      for (uint32_t tile : tiles) {
        for (uint32_t stage : stages) {
          for (uint16_t cluster : kClusterShapes) {
            cublasLtMatmulAlgo_t algo = base;
            bool ok = set_config(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, tile) &&
                      set_config(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, stage) &&
                      set_config(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cluster) &&
                      set_config(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, static_cast<uint32_t>(split_k));
            if (ok && split_k > 1) ok = set_config(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, scheme);
            cublasLtMatmulHeuristicResult_t result{};
            if (!ok || cublasLtMatmulAlgoCheck(handle, plan.desc, plan.w_layout, plan.a_layout,
                                               plan.out_layout, plan.out_layout, &algo,
                                               &result) != CUBLAS_STATUS_SUCCESS ||
                result.state != CUBLAS_STATUS_SUCCESS || result.workspaceSize > workspace) {
              continue;
            }
            result.algo = algo;  // (AlgoCheck leaves the result's algo unset)
            found.push_back(result);
            if (found.size() >= limit) return found;
          }
        }
      }
    }
  }
  return found;
}

void choose_algo(cublasLtHandle_t handle, Plan& plan, const PlanKey& key, const Operands& ops,
                 bool tune) {
  auto found = candidates(handle, plan, ops.workspace_size, key.alignment,
                          tune ? kHeuristicCandidates : 1);
  plan.algo = found[0].algo;
  plan.algo_workspace = found[0].workspaceSize;
  plan.candidates = static_cast<int>(found.size());
  plan.chosen_rank = 0;
  if (!tune) return;
  if (found.size() < kTuneCandidates) {
    for (auto& more : enumerated(handle, plan, key, ops.workspace_size, kTuneCandidates - found.size())) {
      found.push_back(more);
    }
  }
  plan.candidates = static_cast<int>(found.size());
  // Pass 1: one timed run each (rank 0, the heuristic's first choice, always goes on), within
  // the budget (a run and its warm-up counted as twice the timed run).
  std::vector<std::pair<float, size_t>> first;
  float spent_us = 0.f;
  size_t timed = 0;
  for (size_t rank = 0; rank < found.size() && spent_us < kTuneBudgetUs; ++rank, ++timed) {
    const float us = time_algo(handle, plan, found[rank].algo, ops, 1, 1);
    if (us > 0.f) {
      first.emplace_back(rank == 0 ? 0.f : us, rank);
      spent_us += 2.f * us;
    }
  }
  plan.timed_candidates = static_cast<int>(timed);
  const size_t finalists = std::min(first.size(), kTuneFinalists + 1);
  std::partial_sort(first.begin(), first.begin() + finalists, first.end());
  // Pass 2: the finalists' medians.
  float best = -1.f;
  for (size_t i = 0; i < finalists; ++i) {
    const size_t rank = first[i].second;
    const float us = time_algo(handle, plan, found[rank].algo, ops, 1, kTuneRuns);
    if (rank == 0) plan.heuristic_us = us;
    if (us > 0.f && (best < 0.f || us < best)) {
      best = us;
      plan.algo = found[rank].algo;
      plan.algo_workspace = found[rank].workspaceSize;
      plan.chosen_rank = static_cast<int>(rank);
    }
  }
  TORCH_CHECK(best > 0.f, kOp, ": none of cuBLASLt's ", found.size(),
              " FP8 GEMM candidates ran for this problem");
  plan.chosen_us = best;
  plan.tuned = true;
}

template <typename T>
T algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written) !=
      CUBLAS_STATUS_SUCCESS) {
    return T{};
  }
  return value;
}

// `t` as cuBLASLt reads it: contiguous and 16-byte aligned (a copy if it is not, e.g. a view
// with an odd storage offset, which traced graphs may hand over).
torch::Tensor dense_aligned(const torch::Tensor& t) {
  const bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignBytes == 0;
  return t.is_contiguous() && aligned ? t : t.clone(at::MemoryFormat::Contiguous);
}

torch::Tensor checked_operand(const torch::Tensor& t, const char* name, int64_t rows, int64_t cols,
                              const torch::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == at::ScalarType::Float8_e4m3fn, kOp, ": ", name,
              " must be float8_e4m3fn; got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, kOp, ": ", name,
              " must be [", rows, ", ", cols, "]; got ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), kOp, ": ", name, " is on ", t.device(),
              ", the activation on ", like.device());
  return dense_aligned(t);
}

torch::Tensor checked_vector(const torch::Tensor& t, const char* name, at::ScalarType dtype,
                             int64_t size, const torch::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == dtype && t.numel() == size, kOp, ": ", name, " must be a ", dtype,
              " with ", size, " values; got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), kOp, ": ", name, " is on ", t.device(),
              ", the activation on ", like.device());
  return dense_aligned(t);
}

}  // namespace
}  // namespace omni::quant

torch::Tensor fp8_gemm_cublaslt(const torch::Tensor& a_in, const torch::Tensor& a_scale_in,
                                const torch::Tensor& w_in, const torch::Tensor& w_scale_in,
                                const std::optional<torch::Tensor>& bias_in,
                                at::ScalarType out_dtype, bool use_fast_accum, bool tune) {
  using namespace omni::quant;
  TORCH_CHECK(a_in.is_cuda(), kOp, ": a must be a CUDA tensor; got one on ", a_in.device());
  TORCH_CHECK(a_in.dim() == 2 && w_in.dim() == 2, kOp,
              ": a [M, K] and w [N, K] must be 2-D; got ", a_in.sizes(), " and ", w_in.sizes());
  const int64_t m = a_in.size(0), k = a_in.size(1), n = w_in.size(0);
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf, kOp,
              ": out_dtype must be bfloat16 or float16; got ", out_dtype);
  TORCH_CHECK(k > 0 && n > 0 && k % kAlignBytes == 0 && n % kAlignBytes == 0, kOp,
              ": K and N must be positive multiples of ", kAlignBytes, "; got K=", k, ", N=", n);
  const torch::Tensor a = checked_operand(a_in, "a", m, k, a_in);
  const torch::Tensor w = checked_operand(w_in, "w", n, k, a_in);
  const torch::Tensor a_scale = checked_vector(a_scale_in, "a_scale", at::kFloat, m, a_in);
  const torch::Tensor w_scale = checked_vector(w_scale_in, "w_scale", at::kFloat, n, a_in);
  std::optional<torch::Tensor> bias;
  if (bias_in.has_value()) bias = checked_vector(*bias_in, "bias", out_dtype, n, a_in);

  const c10::cuda::CUDAGuard device_guard(a.device());
  auto out = torch::empty({m, n}, a.options().dtype(out_dtype));
  if (m == 0) return out;  // no rows: nothing to multiply (cuBLASLt refuses empty problems)
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const Operands ops{w.data_ptr(), a.data_ptr(), out.data_ptr(), at::cuda::getCUDABlasLtWorkspace(),
                     at::cuda::getCUDABlasLtWorkspaceSize(), stream};
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  // Timing synchronizes the stream, which a capture forbids: inside one the heuristic's
  // first choice runs, and the plan is tuned by the first call outside.
  const bool may_time = tune && capture == cudaStreamCaptureStatusNone;

  const std::array<const void*, 4> pointers = {a.data_ptr(), w.data_ptr(), out.data_ptr(),
                                                bias ? bias->data_ptr() : out.data_ptr()};
  const bool wide = std::all_of(pointers.begin(), pointers.end(), [](const void* ptr) {
    return reinterpret_cast<uintptr_t>(ptr) % kWideAlignBytes == 0;
  });
  const PlanKey key{a.get_device(), m,  n, k, out_dtype, bias.has_value(), use_fast_accum,
                    static_cast<uint32_t>(wide ? kWideAlignBytes : kAlignBytes)};
  PlanCache& cache = plan_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  auto& slot = cache.plans[key];
  if (!slot) slot = make_plan(key);
  Plan& plan = *slot;
  // The pointers change per call; the descriptor is shared, hence the lock over the enqueue.
  set_desc(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, w_scale.data_ptr(), "A_SCALE_POINTER");
  set_desc(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale.data_ptr(), "B_SCALE_POINTER");
  if (bias.has_value()) {
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->data_ptr(), "BIAS_POINTER");
  }
  if (plan.candidates == 0 || (may_time && !plan.tuned)) choose_algo(handle, plan, key, ops, may_time);
  OMNI_CUBLASLT_CHECK(run(handle, plan, plan.algo, ops), "cublasLtMatmul");
  return out;
}

std::vector<std::string> fp8_gemm_cublaslt_plans() {
  using namespace omni::quant;
  PlanCache& cache = plan_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  std::vector<std::string> lines;
  for (const auto& [key, plan] : cache.plans) {
    if (!plan || plan->candidates == 0) continue;
    std::ostringstream line;
    line << "cuda:" << key.device << " M=" << key.m << " N=" << key.n << " K=" << key.k << " "
         << key.out_dtype << (key.bias ? " +bias" : "")
         << (key.fast_accum ? " fast-accum" : " promoted-accum") << " align " << key.alignment
         << ": algo " << algo_config<int32_t>(plan->algo, CUBLASLT_ALGO_CONFIG_ID) << " tile "
         << algo_config<uint32_t>(plan->algo, CUBLASLT_ALGO_CONFIG_TILE_ID) << " stages "
         << algo_config<uint32_t>(plan->algo, CUBLASLT_ALGO_CONFIG_STAGES_ID) << " split-k "
         << algo_config<uint32_t>(plan->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) << " cluster "
         << algo_config<uint16_t>(plan->algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)
         << " workspace " << plan->algo_workspace << " B; ";
    if (plan->tuned) {
      line << "tuned: rank " << plan->chosen_rank << " of " << plan->candidates << " candidates ("
           << plan->timed_candidates << " timed), " << plan->chosen_us << " us (heuristic's first "
           << plan->heuristic_us << " us)";
    } else {
      line << "heuristic's first of " << plan->candidates;
    }
    lines.push_back(line.str());
  }
  std::sort(lines.begin(), lines.end());
  return lines;
}
#endif  // OMNI_HAS_CUBLASLT_FP8
