// FP8 W8A8 GEMM with row-wise scales on Hopper: CUTLASS's warp-specialized cooperative mainloop
// (TMA loads, two consumer warpgroups on one 128x128 tile, FP8 partial sums promoted to float32)
// under the stream-K tile scheduler, and an epilogue visitor tree that applies both scale
// vectors and the bias before the bfloat16 store. See fp8_gemm_cutlass.h for the operation.
//
// CUTLASS is header-only; the build compiles this file only when its headers are found
// (CMakeLists.txt: OMNI_CUTLASS_INCLUDE_DIR, from the nvidia-cutlass wheel) and for sm_90a.
#include "fp8_gemm_cutlass.h"

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

namespace omni {
namespace quant {
namespace {

using namespace cute;

using ElementFp8 = cutlass::float_e4m3_t;
using ElementOut = cutlass::bfloat16_t;
using TileShape = Shape<_128, _128, _128>;
// a [M, K] row-major (K-major A); w [N, K] row-major is CUTLASS's column-major K x N B.
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutOut = cutlass::layout::RowMajor;
constexpr int kFp8Alignment = 16;  // elements: 16 bytes, TMA's unit
constexpr int kOutAlignment = 8;

// Epilogue: out = bf16(a_scale[m] * (w_scale[n] * acc) + bias[n]). The broadcasts read global
// memory straight into registers (no shared-memory stage); a null bias reads as 0.
namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
using Accumulator = fusion::Sm90AccFetch;
using WeightScale = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, int64_t>>;
using ActivationScale =
    fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<_1, _0, int64_t>>;
using Bias = fusion::Sm90RowBroadcast<0, TileShape, ElementOut, float, Stride<_0, _1, int64_t>>;
using ScaledByWeight =
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, WeightScale,
                    Accumulator>;
using EpilogueTree =
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiply_add, ElementOut, float, kRound>,
                    ActivationScale, ScaledByWeight, Bias>;

template <class ClusterShape>
struct Fp8RowwiseGemm {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutOut,
      kOutAlignment, ElementOut, LayoutOut, kOutAlignment,
      cutlass::epilogue::TmaWarpSpecializedCooperative, EpilogueTree>::CollectiveOp;

  // KernelTmaWarpSpecializedCooperative (not ...FP8FastAccum): the builder picks the FP8
  // mainloop that promotes the tensor cores' partial sums to float32 registers.
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementFp8, LayoutA, kFp8Alignment,
      ElementFp8, LayoutB, kFp8Alignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue,
                                                      cutlass::gemm::StreamKScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const CutlassFp8GemmProblem& p) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    // Row strides as given (views of a larger buffer run in place); batch strides unused.
    StrideA stride_a = make_stride(p.lda, Int<1>{}, int64_t{0});
    StrideB stride_b = make_stride(p.ldw, Int<1>{}, int64_t{0});
    StrideD stride_d = make_stride(p.ldo, Int<1>{}, int64_t{0});

    typename EpilogueTree::Arguments tree{
        {p.a_scale, 0.f, {}},                                    // ActivationScale
        {{p.w_scale, 0.f, {}}, {}, {}},                          // ScaledByWeight
        {static_cast<const ElementOut*>(p.bias), ElementOut(0.f), {}},  // Bias
        {}};                                                     // multiply_add

    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = p.device;
    hw_info.sm_count = p.sm_count;

    using Scheduler = typename Gemm::GemmKernel::TileSchedulerArguments;
    Scheduler scheduler;
    scheduler.splits = p.decomposition == CutlassDecomposition::kSplitK ? p.splits : 1;
    using Mode = cutlass::gemm::kernel::detail::DecompositionMode;
    switch (p.decomposition) {
      case CutlassDecomposition::kDataParallel: scheduler.decomposition_mode = Mode::DataParallel; break;
      case CutlassDecomposition::kStreamK: scheduler.decomposition_mode = Mode::StreamK; break;
      case CutlassDecomposition::kSplitK: scheduler.decomposition_mode = Mode::SplitK; break;
      default: scheduler.decomposition_mode = Mode::Heuristic; break;
    }
    // Deterministic turnstile reduction of partial tiles: the same inputs give the same bits.
    scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;

    return typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1},
        {static_cast<const ElementFp8*>(p.a), stride_a, static_cast<const ElementFp8*>(p.w),
         stride_b},
        {tree, nullptr, stride_d, static_cast<ElementOut*>(p.out), stride_d},
        hw_info,
        scheduler};
  }

  static std::string workspace(const CutlassFp8GemmProblem& p, size_t* bytes) {
    const auto args = arguments(p);
    const cutlass::Status status = Gemm::can_implement(args);
    if (status != cutlass::Status::kSuccess) {
      return std::string("CUTLASS cannot run this problem: ") + cutlassGetStatusString(status);
    }
    *bytes = Gemm::get_workspace_size(args);
    return {};
  }

  static std::string run(const CutlassFp8GemmProblem& p, void* workspace, cudaStream_t stream) {
    Gemm gemm;
    const auto args = arguments(p);
    cutlass::Status status = gemm.initialize(args, workspace, stream);
    if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess) {
      return std::string("CUTLASS FP8 GEMM failed: ") + cutlassGetStatusString(status);
    }
    return {};
  }
};

using Gemm1x1 = Fp8RowwiseGemm<Shape<_1, _1, _1>>;
using Gemm2x1 = Fp8RowwiseGemm<Shape<_2, _1, _1>>;

}  // namespace

std::string cutlass_fp8_gemm_workspace(const CutlassFp8GemmProblem& problem, size_t* bytes) {
  return problem.cluster == CutlassCluster::k2x1 ? Gemm2x1::workspace(problem, bytes)
                                                 : Gemm1x1::workspace(problem, bytes);
}

std::string cutlass_fp8_gemm_run(const CutlassFp8GemmProblem& problem, void* workspace,
                                 cudaStream_t stream) {
  return problem.cluster == CutlassCluster::k2x1 ? Gemm2x1::run(problem, workspace, stream)
                                                 : Gemm1x1::run(problem, workspace, stream);
}

}  // namespace quant
}  // namespace omni
