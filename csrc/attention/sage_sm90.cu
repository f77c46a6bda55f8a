// Quantized attention forward for Hopper (sm_90a): S = Q_int8 K_int8^T with wgmma s8 (exact,
// int32), online softmax in base 2 with the running max shifted by log2(448) so P fills FP8's
// range, P V with wgmma e4m3 (P from registers, V^T from shared memory) into a fresh float32
// tile per key block that is then folded into the output accumulator (two-level accumulation:
// the FP8 MMA's own accumulator keeps ~14 bits and never sums across blocks). The softmax's
// row sums come from the same MMA: each V^T stage carries 8 rows of ones after its 128, so the
// m64n136 product returns P's row sums beside P V (one FADD a score fewer; the softmax bounds
// the kernel), summed over the FP8-rounded P that multiplies V. V has one scale a key block;
// the accumulator's P V columns are kept in units of u, the latest nonzero block scale, so the
// fold stays one FMA an element: o = o * (alpha * u / v_scale_j) + pv, then u = v_scale_j (a
// zero-scale block, whose pv is 0, keeps u); the row sums take alpha alone; the epilogue writes
// o * u / l. The quantizer keeps every nonzero V scale >= 2^-30 (reference.V_AMAX_FLOOR), which
// bounds u_old / u_new, so o stays finite for |V| < ~1e20 without a check in the loop (a
// checked fold, or a per-CTA range test choosing it, was slower). The math is
// omni_kernels/attention/quantized/reference.py's, step for step (but for where the unit trick
// applies V's scales), with row_sums="fp8".
//
// A CTA handles 128 query rows of one (batch, head): three warpgroups, warp-specialized.
//   * warpgroup 0, the producer: one thread issues TMA loads (Q once; K and V^T tiles of 128 keys
//     through a kStages-deep ring) and gives its registers to the consumers (setmaxnreg).
//   * warpgroups 1 and 2, the consumers: 64 query rows each; they share every K/V tile and take
//     turns issuing MMAs (ping-pong on named barriers), so one computes its softmax while the
//     other's MMAs run. A turn issues block j's P V and block j+1's Q K^T together; the fold of
//     block j then overlaps that Q K^T.
// Shared memory tiles are [rows][128 bytes] with the 128-byte swizzle that TMA writes and wgmma
// reads (both K-major: 8-bit wgmma operands must be).
//
// A partial last wave (sage_split_plan in sage_sm90_params.h): its query blocks run as a second
// launch (the kSplit instantiation), each cut into key ranges, one CTA each; a part stores its
// unnormalized accumulator (times its u: in V's real units, so parts of different units merge
// as they are), running max and row sum, and the part that finishes last (a counter
// per block) merges the others' and writes the output and LSE.
//
// Launched as a programmatic dependent (PDL) of the quantizer's kernel when the caller asks: a
// CTA initializes its barriers and the ones rows while the quantizer's last wave runs, then
// waits (griddepcontrol.wait) for that grid before its first global read.
//
// P as an A operand: a thread's float32 accumulator holds, per 8-column chunk c, the columns
// 8c + 2t and 8c + 2t + 1 (t = lane % 4) of rows g and g + 8 (g = lane / 4); an 8-bit A
// fragment wants columns 4t..4t+3 (and 16 + 4t..) of one row in each register. Instead of
// shuffling P between threads, the quantizer stores V^T's keys permuted within each group of
// 16 (logical column 4t + i holds key 2t + (i % 2) + 8 (i / 2)), so each thread packs its own
// values: register 0 of k-step kk = P[g][32kk + {2t, 2t+1, 8+2t, 9+2t}], and so on.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "sage_sm90_params.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  #define OMNI_SAGE_SM90_DEVICE 1
#endif

namespace omni {
namespace attention {
namespace {

constexpr int kBlockM = 128;  // query rows a CTA
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kStages = 3;
constexpr int kTileBytes = 128 * 128;  // a [128][128 B] tile of Q, K or V^T
// A V^T stage: the [128 dims][128 keys] tile TMA loads, then 8 rows of e4m3 ones written once
// (one 1024-byte swizzle atom), so the P V MMA (m64n136) also returns P's row sums.
constexpr int kOnesRows = 8;
constexpr int kVStageBytes = (128 + kOnesRows) * 128;
constexpr uint8_t kE4m3One = 0x38;

struct SharedStorage {
  alignas(1024) uint8_t q[kTileBytes];
  alignas(1024) uint8_t k[kStages][kTileBytes];
  alignas(1024) uint8_t v[kStages][kVStageBytes];
  alignas(8) uint64_t q_full;
  uint64_t k_full[kStages];
  uint64_t v_full[kStages];
  uint64_t kv_empty[kStages];
  int split_last;  // a split part: whether this CTA finished last (it merges the others)
};

#ifdef OMNI_SAGE_SM90_DEVICE

constexpr int kRowsPerConsumer = 64;  // one warpgroup's wgmma M
constexpr int kConsumerThreads = 128 * kConsumers;
constexpr float kShift = 8.807354922057604f;  // log2(448)
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Waits for the phase of `bar` with this parity to complete. kTrap (the producer's waits): a
// wait that outlasts ~2^36 cycles (~35 s; a tile's data takes microseconds) is a pipeline bug,
// so trap and the launch fails with an error instead of hanging the GPU. The consumers' waits
// never trap: a trap anywhere in their code makes ptxas allocate them the kernel-wide 168
// registers instead of setmaxnreg's 240 (checked in the SASS), and a stuck consumer leaves the
// producer waiting for its release, which traps.
template <bool kTrap = false>
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  const long long start = clock64();
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    if (kTrap && !done && clock64() - start > (1ll << 36)) __trap();
  } while (!done);
}

// Non-blocking: whether the phase of `bar` with this parity has completed. The consumers test
// their next tiles before the softmax and block (mbar_wait) after it only if one was not ready:
// the check's latency then hides behind the softmax instead of sitting between it and the MMAs.
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// ---- TMA: a 2-D box into shared memory, completion counted on `bar` (bytes)
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int32_t inner, int32_t outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(inner), "r"(outer)
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- wgmma
// Descriptor of a K-major [rows][128 B] tile with the 128-byte swizzle: 8-row groups 1024 B
// apart (stride byte offset); the leading byte offset is unused by swizzled K-major layouts.
// A k-step of 32 bytes inside the swizzle atom advances the start address (units of 16 B).
__device__ __forceinline__ uint64_t tile_descriptor(const void* tile) {
  uint64_t desc = (smem_u32(tile) & 0x3FFFF) >> 4;
  desc |= uint64_t{1} << 16;
  desc |= uint64_t{1024 >> 4} << 32;
  desc |= uint64_t{1} << 62;
  return desc;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending of this warpgroup's committed wgmma groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving or copying an accumulator register across this point (the
// wgmma writes it asynchronously until the wait that precedes this).
template <typename T, int N>
__device__ __forceinline__ void fence_operands(T (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(reinterpret_cast<uint32_t&>(d[i]))::"memory");
}

// ---- programmatic dependent launch: waits until the grids this one depends on (the stream's
// previous kernel, when launched with the PDL attribute) have completed and their writes are
// visible; returns at once for a plain launch.
__device__ __forceinline__ void wait_for_previous_grid() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// ---- named barriers (id 0 is __syncthreads')
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The 64 accumulator operands of an m64n128 wgmma; C is the constraint ("+r" or "+f").
#define OMNI_WGMMA_ACC64(C, d) \
  C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), C(d[8]), C(d[9]), \
      C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]), C(d[16]), C(d[17]), \
      C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), C(d[24]), C(d[25]), \
      C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31]), C(d[32]), C(d[33]), \
      C(d[34]), C(d[35]), C(d[36]), C(d[37]), C(d[38]), C(d[39]), C(d[40]), C(d[41]), \
      C(d[42]), C(d[43]), C(d[44]), C(d[45]), C(d[46]), C(d[47]), C(d[48]), C(d[49]), \
      C(d[50]), C(d[51]), C(d[52]), C(d[53]), C(d[54]), C(d[55]), C(d[56]), C(d[57]), \
      C(d[58]), C(d[59]), C(d[60]), C(d[61]), C(d[62]), C(d[63])

// The operand names of the 64 accumulator registers, and of an m64n136 wgmma's 68.
#define OMNI_WGMMA_D64_NAMES                                                                 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"
#define OMNI_WGMMA_D64_LIST "{" OMNI_WGMMA_D64_NAMES "}"
#define OMNI_WGMMA_D68_LIST "{" OMNI_WGMMA_D64_NAMES ", %64, %65, %66, %67}"

// d[64] (int32, m64n128) (+)= A (s8, shared) x B (s8, shared)^T over 32 of K.
// accumulate == 0 starts a fresh sum (the instruction's own zeroing: setting the accumulator
// with ordinary instructions costs 64 moves a block; a start from the bits of 1.5 * 2^23, which
// let the scores be read without an int-to-float conversion, was slower).
__device__ __forceinline__ void wgmma_s8(uint32_t (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                         int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " OMNI_WGMMA_D64_LIST
      ", %64, %65, p;\n}\n"
      : OMNI_WGMMA_ACC64("+r", d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d[68] (float32, m64n136) (+)= A (e4m3, registers a[4]) x B (e4m3, shared)^T over 32 of K:
// P V^T with V^T's 8 rows of ones after its 128 (d[64..67]: the row sums of P).
#define OMNI_WGMMA_ACC68(C, d) \
  OMNI_WGMMA_ACC64(C, d), C(d[64]), C(d[65]), C(d[66]), C(d[67])
__device__ __forceinline__ void wgmma_e4m3_rs_n136(float (&d)[68], const uint32_t (&a)[4],
                                                   uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %73, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 " OMNI_WGMMA_D68_LIST
      ", {%68, %69, %70, %71}, %72, p, 1, 1;\n}\n"
      : OMNI_WGMMA_ACC68("+f", d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

#undef OMNI_WGMMA_ACC68
#undef OMNI_WGMMA_ACC64
#undef OMNI_WGMMA_D64_LIST
#undef OMNI_WGMMA_D68_LIST
#undef OMNI_WGMMA_D64_NAMES

template <uint32_t kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <uint32_t kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats to two e4m3 bytes (round to nearest even, saturating): `lo` in the low byte.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

template <typename OutT>
__device__ __forceinline__ void store_pair(OutT* dst, float a, float b);
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* dst, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ void store_pair<__half>(__half* dst, float a, float b) {
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
}

// ---- the steps of one key block, for one consumer warpgroup (64 query rows)

// s = Q K^T (exact int32), 4 x m64n128k32 s8. The caller fences first (as for issue_pv).
__device__ __forceinline__ void issue_qk(uint32_t (&s)[64], uint64_t q_desc,
                                         const uint8_t* k_tile) {
  const uint64_t k_desc = tile_descriptor(k_tile);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_s8(s, q_desc + 2 * kk, k_desc + 2 * kk, kk);
}

// pv = P [V^T-tile; ones], 4 x m64n136k32 e4m3 with P from registers: pv[0..63] P V, pv[64..67]
// P's row sums (rows g, g, g + 8, g + 8: every column of the ones rows holds the sum). A fresh
// sum (the FP8 MMA's own accumulator never carries across blocks). The caller fences first.
__device__ __forceinline__ void issue_pv(float (&pv)[68], const uint32_t (&pa)[4][4],
                                         const uint8_t* v_stage) {
  const uint64_t v_desc = tile_descriptor(v_stage);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_e4m3_rs_n136(pv, pa[kk], v_desc + 2 * kk, kk);
}

// Online softmax state of this thread's two rows (g and g + 8), base 2, the max kept shifted by
// log2(448) so P fills FP8's range. The row sums l live in the output accumulator (fold).
struct RowSoftmax {
  float q_scale_lo, q_scale_hi;
  // m starts finite, so a row whose keys are all masked never forms (-inf) - (-inf).
  float m_lo = -1.0e30f, m_hi = -1.0e30f;

  // Block j's probabilities into pf (the accumulator layout), its rescale factors into alpha.
  // kMasked: keys past kv_len are masked (the caller passes true for the last block alone when
  // kv_len is not a multiple of kSageBlockN: the compare-and-selects cost ~3 instructions a
  // score, and the softmax bounds the kernel). s is only read here. Every exp2 is
  // ex2.approx: a share on the FMA pipes (a polynomial, 1 to 4 of every 8 scores) was slower.
  template <bool kMasked>
  __device__ __forceinline__ void exps(const uint32_t (&s)[64], float (&pf)[64], int j, int kv_len,
                                       float k_factor, int t, float& alpha_lo, float& alpha_hi) {
    const int valid_cols = kv_len - j * kSageBlockN - 2 * t;  // col 8c + 2t + e valid if < this
    const auto masked = [&](int i) { return kMasked && 8 * (i / 4) + (i % 2) >= valid_cols; };
    // Four independent partial maxima a row, then a tree: one dependent chain of 32 max
    // operations a row was slower (its latency sits in the softmax).
    int part_lo[4], part_hi[4];  // INT32_MIN stands for "masked"
#pragma unroll
    for (int c = 0; c < 4; ++c) part_lo[c] = part_hi[c] = INT32_MIN;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int v = masked(i) ? INT32_MIN : static_cast<int>(s[i]);
      if ((i / 2) % 2 == 0) {
        part_lo[(i / 4) % 4] = max(part_lo[(i / 4) % 4], v);
      } else {
        part_hi[(i / 4) % 4] = max(part_hi[(i / 4) % 4], v);
      }
    }
    int max_lo = max(max(part_lo[0], part_lo[1]), max(part_lo[2], part_lo[3]));
    int max_hi = max(max(part_hi[0], part_hi[1]), max(part_hi[2], part_hi[3]));
#pragma unroll
    for (int offset = 1; offset < 4; offset <<= 1) {
      max_lo = max(max_lo, __shfl_xor_sync(0xffffffffu, max_lo, offset));
      max_hi = max(max_hi, __shfl_xor_sync(0xffffffffu, max_hi, offset));
    }
    // The reference's rounding order: q_scale * (k_scale * scale * log2(e)). factor >= 0, so
    // max(s) * factor == max(s * factor). A row with this block all masked keeps its max.
    const float f_lo = q_scale_lo * k_factor, f_hi = q_scale_hi * k_factor;
    const float block_max_lo =
        max_lo == INT32_MIN ? -1.0e30f : static_cast<float>(max_lo) * f_lo - kShift;
    const float block_max_hi =
        max_hi == INT32_MIN ? -1.0e30f : static_cast<float>(max_hi) * f_hi - kShift;
    const float m_new_lo = fmaxf(m_lo, block_max_lo);
    const float m_new_hi = fmaxf(m_hi, block_max_hi);
    alpha_lo = fast_exp2(m_lo - m_new_lo);
    alpha_hi = fast_exp2(m_hi - m_new_hi);
    m_lo = m_new_lo;
    m_hi = m_new_hi;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const bool hi = (i / 2) % 2 == 1;
      const float score = static_cast<float>(static_cast<int>(s[i]));  // exact: |s| < 2^22
      const float x = fmaf(score, hi ? f_hi : f_lo, -(hi ? m_hi : m_lo));
      float e = fast_exp2(x);
      if (masked(i)) e = 0.0f;
      pf[i] = e;
    }
  }
};

// P to e4m3 A fragments, k-step kk = keys [32kk, 32kk + 32) in V^T's permuted order.
__device__ __forceinline__ void pack_p(const float (&pf)[64], uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const float* c0 = pf + 16 * kk;  // chunk 4kk: [row g: 2 values][row g+8: 2 values]
    pa[kk][0] = e4m3x2(c0[0], c0[1]) | (e4m3x2(c0[4], c0[5]) << 16);
    pa[kk][1] = e4m3x2(c0[2], c0[3]) | (e4m3x2(c0[6], c0[7]) << 16);
    pa[kk][2] = e4m3x2(c0[8], c0[9]) | (e4m3x2(c0[12], c0[13]) << 16);
    pa[kk][3] = e4m3x2(c0[10], c0[11]) | (e4m3x2(c0[14], c0[15]) << 16);
  }
}

// o = o * alpha + pv, alpha per row (lo: row g, hi: row g + 8); the P V columns o[0..63] also
// change units (unit_ratio = u_old / u_new, see the file's header), while o[64..67], the running
// row sums l (the online softmax's l = l * alpha + sum, in the same FMAs), take alpha alone.
__device__ __forceinline__ void fold(float (&o)[68], const float (&pv)[68], float alpha_lo,
                                     float alpha_hi, float unit_ratio) {
  const float scale_lo = alpha_lo * unit_ratio, scale_hi = alpha_hi * unit_ratio;
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = fmaf(o[i], (i / 2) % 2 ? scale_hi : scale_lo, pv[i]);
#pragma unroll
  for (int i = 64; i < 68; ++i) o[i] = fmaf(o[i], (i / 2) % 2 ? alpha_hi : alpha_lo, pv[i]);
}

#endif  // OMNI_SAGE_SM90_DEVICE

// kSplit: this launch runs the split parts of the last wave's query blocks (a separate
// instantiation: folding a runtime split into the one kernel slowed its main loop).
template <typename OutT, bool kSplit>
__global__ void __launch_bounds__(kThreads, 1)
    sage_sm90_kernel(const __grid_constant__ SageSm90Params p,
                     const __grid_constant__ CUtensorMap q_map,
                     const __grid_constant__ CUtensorMap k_map,
                     const __grid_constant__ CUtensorMap v_map) {
#ifdef OMNI_SAGE_SM90_DEVICE
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Dynamic shared memory is 16-byte aligned by contract; the swizzled tiles need 1024.
  auto& smem = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});

  const int num_m_blocks = (p.shape.seq_q + kBlockM - 1) / kBlockM;
  // A split launch's CTAs take one of `splits` key ranges of a query block from split_first
  // on (see sage_split_plan); the parts of a block are adjacent, so they run together.
  const int parts = kSplit ? p.splits : 1;
  const int part = kSplit ? static_cast<int>(blockIdx.x) % parts : 0;
  const int block = kSplit ? p.split_first + static_cast<int>(blockIdx.x) / parts
                           : static_cast<int>(blockIdx.x);
  const int m_block = block % num_m_blocks;  // query blocks of a head adjacent: K/V via L2
  const int bh = block / num_m_blocks;
  const int b = bh / p.shape.heads;
  const int h = bh % p.shape.heads;
  const int kv_bh = b * p.shape.kv_heads + h / (p.shape.heads / p.shape.kv_heads);
  const int warpgroup = threadIdx.x / 128;

  // The ones rows after every V^T stage's tile, written once (TMA never touches them). The proxy
  // fence orders these ordinary stores before wgmma's (async proxy) reads after the barrier.
  constexpr int kOnesWords = kOnesRows * 128 / 8;
  for (int i = threadIdx.x; i < kStages * kOnesWords; i += kThreads) {
    reinterpret_cast<uint64_t*>(smem.v[i / kOnesWords] + kTileBytes)[i % kOnesWords] =
        0x0101010101010101ull * kE4m3One;
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  if (threadIdx.x == 0) {
    mbar_init(&smem.q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&smem.k_full[s], 1);
      mbar_init(&smem.v_full[s], 1);
      mbar_init(&smem.kv_empty[s], kConsumerThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Everything above touches only this CTA's shared memory; with PDL it overlapped the
  // quantizer's last wave. Every global read comes after this (key_lengths too: a kernel of the
  // caller's may have written it just before the quantizer ran).
  wait_for_previous_grid();
  int kv_len = p.shape.seq_kv;
  if (p.key_lengths != nullptr) kv_len = min(max(p.key_lengths[b], 0), p.shape.seq_kv);
  const int kv_blocks = (kv_len + kSageBlockN - 1) / kSageBlockN;
  // this CTA's key blocks: [j_begin, j_begin + num_n_blocks) (a split part may get none)
  const int part_blocks = (kv_blocks + parts - 1) / parts;
  const int j_begin = min(part * part_blocks, kv_blocks);
  const int num_n_blocks = min(kv_blocks - j_begin, part_blocks);

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    registers_decrease<24>();
    if (threadIdx.x == 0) {
      tma_prefetch_descriptor(&q_map);
      tma_prefetch_descriptor(&k_map);
      tma_prefetch_descriptor(&v_map);
      // Rows past this head's Sq belong to the next head (or are out of bounds: zeros); their
      // scores are computed and never stored.
      mbar_expect_tx(&smem.q_full, kTileBytes);
      tma_load_2d(smem.q, &q_map, &smem.q_full, 0, bh * p.shape.seq_q + m_block * kBlockM);
      const int k_row0 = kv_bh * p.shape.seq_kv_pad;
      const int v_row0 = kv_bh * kSageHeadDim;
      for (int j = 0; j < num_n_blocks; ++j) {
        const int stage = j % kStages;
        if (j >= kStages) mbar_wait<true>(&smem.kv_empty[stage], ((j / kStages) - 1) & 1);
        mbar_expect_tx(&smem.k_full[stage], kTileBytes);
        const int key0 = (j_begin + j) * kSageBlockN;
        tma_load_2d(smem.k[stage], &k_map, &smem.k_full[stage], 0, k_row0 + key0);
        mbar_expect_tx(&smem.v_full[stage], kTileBytes);
        tma_load_2d(smem.v[stage], &v_map, &smem.v_full[stage], key0, v_row0);
      }
      // Stay until the consumers have released the last stages: a consumer that never gets its
      // data then shows as this wait's trap (theirs do not trap) instead of a hung GPU.
      for (int j = max(0, num_n_blocks - kStages); j < num_n_blocks; ++j) {
        mbar_wait<true>(&smem.kv_empty[j % kStages], (j / kStages) & 1);
      }
    }
  } else {
    // ------------------------------------------------------------------ consumers
    // (each role one branch of a single if/else: ptxas applies setmaxnreg only so)
    registers_increase<240>();
    const int consumer = warpgroup - 1;
    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x % 128) / 32;
    const int g = lane / 4;  // this thread's rows: g and g + 8 of its warp's 16
    const int t = lane % 4;  // and columns 8c + 2t, 8c + 2t + 1 of every 8-column chunk c
    const int row_lo = m_block * kBlockM + consumer * kRowsPerConsumer + warp * 16 + g;
    const int row_hi = row_lo + 8;
    const int64_t q_index = static_cast<int64_t>(bh) * p.shape.seq_q;
    const float q_scale_lo = row_lo < p.shape.seq_q ? p.q_scale[q_index + row_lo] : 0.0f;
    const float q_scale_hi = row_hi < p.shape.seq_q ? p.q_scale[q_index + row_hi] : 0.0f;
    const int64_t scale_index =
        static_cast<int64_t>(kv_bh) * (p.shape.seq_kv_pad / kSageBlockN) + j_begin;
    const float* k_scale = p.k_scale + scale_index;
    const float* v_scale = p.v_scale + scale_index;

    RowSoftmax rows{q_scale_lo, q_scale_hi};
    float o[68];  // P V (in units of u) and, in o[64..67], the row sums
    float u = 0.0f;  // the latest nonzero V block scale (0: none yet, and o[0..63] are 0)
#pragma unroll
    for (int i = 0; i < 68; ++i) o[i] = 0.0f;

    mbar_wait(&smem.q_full, 0);
    const uint64_t q_desc = tile_descriptor(smem.q + consumer * kRowsPerConsumer * 128);
    uint32_t s[64];        // S of the current block (int32)
    float pf[64];          // its probabilities
    float pv[68];          // P V of one block (and its row sums), a fresh float32 tile
    uint32_t pa[4][4];     // P of one block as e4m3 A fragments
    float alpha_lo, alpha_hi;

    // Warpgroup ping-pong (FlashAttention-3's scheduling): a consumer issues its MMAs only in
    // its turn (named barrier kTurnBarrier + consumer) and then hands the turn to the other, so
    // one warpgroup's softmax runs while the other's MMAs do; left alone, both drift into
    // computing softmax at once with the tensor cores idle. Consumer 0 goes first. Every turn
    // is matched: consumer 1 skips its last hand-over (consumer 0 takes no turn after it).
    constexpr int kTurnBarrier = 1;
    constexpr int kEpilogueBarrier = 3;  // the consumers' own, after their turns
    const auto turn_begin = [&] { named_barrier_sync(kTurnBarrier + consumer, kConsumerThreads); };
    const auto turn_end = [&](bool last) {
      if (!(last && consumer == 1)) {
        named_barrier_arrive(kTurnBarrier + (consumer ^ 1), kConsumerThreads);
      }
    };
    if (consumer == 1 && num_n_blocks > 0) named_barrier_arrive(kTurnBarrier, kConsumerThreads);

    // Block j+1's Q K^T is issued with block j's P V, in one turn: it runs while this
    // warpgroup folds block j.
    if (num_n_blocks > 0) {
      mbar_wait(&smem.k_full[0], 0);
      turn_begin();
      wgmma_fence();
      issue_qk(s, q_desc, smem.k[0]);
      wgmma_commit();
      turn_end(false);
      wgmma_wait<0>();
      fence_operands(s);
    }
    // K's scale is loaded a block ahead: the softmax needs it first thing. V's too, so its
    // load's latency never sits before the fold.
    float k_scale_next = num_n_blocks > 0 ? __ldg(k_scale) : 0.0f;
    float v_scale_next = num_n_blocks > 0 ? __ldg(v_scale) : 0.0f;
    // Block j's ring slot (j % kStages) and phase ((j / kStages) & 1), stepped per block: the
    // divisions by kStages sat at the head of every block's critical path (stepped is
    // faster). ptxas -v then reports a 4-byte spill in the non-split
    // kernels: one value stored at entry and reloaded outside the main loop (SASS checked).
    int stage = 0;
    uint32_t parity = 0;
    // One key block; kMasked (the last block alone, when kv_len is not a multiple of
    // kSageBlockN) masks keys past kv_len. The masked block is peeled off the loop so that
    // each copy is one straight-line block: with the two softmax variants behind a branch,
    // ptxas left P's packing after the join, where it cannot overlap the exponentials.
    const auto step = [&](const int j, auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
      const bool has_next = j + 1 < num_n_blocks;
      const int following = stage + 1 == kStages ? 0 : stage + 1;
      const uint32_t following_parity = following == 0 ? parity ^ 1u : parity;
      // (the last block issues a Q K^T of its own K again, discarded: see below)
      const int next_stage = has_next ? following : stage;
      const bool v_ready = mbar_test(&smem.v_full[stage], parity);
      const bool k_ready = !has_next || mbar_test(&smem.k_full[next_stage], following_parity);
      const float k_factor = k_scale_next * p.qk_scale;
      k_scale_next = __ldg(k_scale + min(j + 1, num_n_blocks - 1));
      // A zero-scale block (its V and pv are 0) keeps the units; u == 0 gives ratio 0 on an o
      // that is still 0. One division a block, shared by both rows.
      const float vs = v_scale_next;
      v_scale_next = __ldg(v_scale + min(j + 1, num_n_blocks - 1));
      const float unit_ratio = vs > 0.0f ? __fdividef(u, vs) : 1.0f;
      if (vs > 0.0f) u = vs;
      // This block's Q K^T (issued in the previous turn) completes here, after the fold and the
      // lines above: waiting at the end of the previous iteration let ptxas hoist the wait
      // above the fold, which then never overlapped the Q K^T.
      wgmma_wait<0>();
      fence_operands(s);
      rows.template exps<kMasked>(s, pf, j_begin + j, kv_len, k_factor, t, alpha_lo, alpha_hi);
      pack_p(pf, pa);
      if (!v_ready) mbar_wait(&smem.v_full[stage], parity);
      // The last block issues a Q K^T of its own K again (discarded): an unconditional group
      // lets ptxas see which accumulators each wait releases (a conditional one serialized the
      // MMAs).
      if (!k_ready) mbar_wait(&smem.k_full[next_stage], following_parity);
      turn_begin();
      wgmma_fence();  // P's fragments and s's last readers, before both groups
      issue_pv(pv, pa, smem.v[stage]);
      wgmma_commit();
      issue_qk(s, q_desc, smem.k[next_stage]);
      wgmma_commit();
      turn_end(!has_next);
      wgmma_wait<1>();
      fence_operands(pv);
      mbar_arrive(&smem.kv_empty[stage]);  // V^T of this stage is no longer read (K may be,
                                           // by the discarded last Q K^T: no load follows it)
      fold(o, pv, alpha_lo, alpha_hi, unit_ratio);
      stage = following;
      parity = following_parity;
    };
    // Only the last block can hold keys past kv_len: every earlier one ends at or before
    // (kv_blocks - 1) * kSageBlockN < kv_len.
    const bool last_masked = num_n_blocks > 0 && (j_begin + num_n_blocks) * kSageBlockN > kv_len;
    const int unmasked_blocks = num_n_blocks - (last_masked ? 1 : 0);
    for (int j = 0; j < unmasked_blocks; ++j) step(j, std::false_type{});
    if (last_masked) step(num_n_blocks - 1, std::true_type{});
    wgmma_wait<0>();  // the discarded last Q K^T
    // Every thread of a quad holds its rows' whole sums (the ones columns 128 + 2t, 129 + 2t).
    float m_lo = rows.m_lo, m_hi = rows.m_hi, l_lo = o[64], l_hi = o[66];
    if constexpr (kSplit) {
      // ---- a split part: store (o, m, l); the part that finishes last merges the others'
      const int local_lo = consumer * kRowsPerConsumer + warp * 16 + g;
      const int64_t item = static_cast<int64_t>(block - p.split_first) * parts;
      float* mine = p.partials + ((item + part) * kBlockM + local_lo) * kSagePartialStride;
      float* mine_hi = mine + 8 * kSagePartialStride;
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        const int col = 8 * c + 2 * t;
        *reinterpret_cast<float2*>(mine + col) = make_float2(o[4 * c] * u, o[4 * c + 1] * u);
        *reinterpret_cast<float2*>(mine_hi + col) =
            make_float2(o[4 * c + 2] * u, o[4 * c + 3] * u);
      }
      if (t == 0) {
        *reinterpret_cast<float2*>(mine + 128) = make_float2(m_lo, l_lo);
        *reinterpret_cast<float2*>(mine_hi + 128) = make_float2(m_hi, l_hi);
      }
      __threadfence();  // the partial is visible device-wide before the count that announces it
      named_barrier_sync(kEpilogueBarrier, kConsumerThreads);
      if (threadIdx.x == 128) {
        smem.split_last = atomicAdd(p.counters + (block - p.split_first), 1) == parts - 1;
      }
      named_barrier_sync(kEpilogueBarrier, kConsumerThreads);
      if (!smem.split_last) return;
      __threadfence();
      // Merge every part in part order, this one's too (read back): the same sums whichever
      // part finishes last, so the output's bits do not depend on the order the CTAs ran in.
      m_lo = m_hi = -1.0e30f;
      l_lo = l_hi = 0.0f;
      u = 1.0f;  // the parts are stored in V's real units
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] = 0.0f;
      for (int other = 0; other < parts; ++other) {
        const float* theirs = p.partials + ((item + other) * kBlockM + local_lo) * kSagePartialStride;
        const float* theirs_hi = theirs + 8 * kSagePartialStride;
        // .cg loads: written by other SMs, never cached in this SM's L1
        const float2 ml_lo = __ldcg(reinterpret_cast<const float2*>(theirs + 128));
        const float2 ml_hi = __ldcg(reinterpret_cast<const float2*>(theirs_hi + 128));
        const float new_lo = fmaxf(m_lo, ml_lo.x), new_hi = fmaxf(m_hi, ml_hi.x);
        const float a_lo = fast_exp2(m_lo - new_lo), b_lo = fast_exp2(ml_lo.x - new_lo);
        const float a_hi = fast_exp2(m_hi - new_hi), b_hi = fast_exp2(ml_hi.x - new_hi);
#pragma unroll
        for (int c = 0; c < 16; ++c) {
          const int col = 8 * c + 2 * t;
          const float2 x_lo = __ldcg(reinterpret_cast<const float2*>(theirs + col));
          const float2 x_hi = __ldcg(reinterpret_cast<const float2*>(theirs_hi + col));
          o[4 * c] = fmaf(o[4 * c], a_lo, x_lo.x * b_lo);
          o[4 * c + 1] = fmaf(o[4 * c + 1], a_lo, x_lo.y * b_lo);
          o[4 * c + 2] = fmaf(o[4 * c + 2], a_hi, x_hi.x * b_hi);
          o[4 * c + 3] = fmaf(o[4 * c + 3], a_hi, x_hi.y * b_hi);
        }
        l_lo = fmaf(l_lo, a_lo, ml_lo.y * b_lo);
        l_hi = fmaf(l_hi, a_hi, ml_hi.y * b_hi);
        m_lo = new_lo;
        m_hi = new_hi;
      }
    }
    // ---- epilogue: out = acc * u / l; lse with K's mean added back
    const float inv_lo = l_lo > 0.0f ? u / l_lo : 0.0f;  // acc is 0 where l is 0
    const float inv_hi = l_hi > 0.0f ? u / l_hi : 0.0f;
    OutT* out_head = static_cast<OutT*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
    OutT* out_lo = out_head + static_cast<int64_t>(row_lo) * p.out_stride_s;
    OutT* out_hi = out_head + static_cast<int64_t>(row_hi) * p.out_stride_s;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const int col = 8 * c + 2 * t;
      if (row_lo < p.shape.seq_q) {
        store_pair(out_lo + col, o[4 * c] * inv_lo, o[4 * c + 1] * inv_lo);
      }
      if (row_hi < p.shape.seq_q) {
        store_pair(out_hi + col, o[4 * c + 2] * inv_hi, o[4 * c + 3] * inv_hi);
      }
    }
    if (p.lse != nullptr && t == 0) {
      if (row_lo < p.shape.seq_q) {
        p.lse[q_index + row_lo] =
            l_lo > 0.0f ? (m_lo + log2f(l_lo)) * kLn2 + p.q_kmean[q_index + row_lo] * p.scale
                        : -INFINITY;
      }
      if (row_hi < p.shape.seq_q) {
        p.lse[q_index + row_hi] =
            l_hi > 0.0f ? (m_hi + log2f(l_hi)) * kLn2 + p.q_kmean[q_index + row_hi] * p.scale
                        : -INFINITY;
      }
    }
  }
#else
  __trap();  // built without sm_90a code: the host checks for the image before launching
#endif  // OMNI_SAGE_SM90_DEVICE
}

// ---- host side: TMA descriptors (the driver's encoder, reached through the runtime so the
// extension need not link libcuda)
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

cudaError_t encode_tiled_function(EncodeTiledFn* fn) {
  static EncodeTiledFn cached = nullptr;
  if (cached == nullptr) {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry,
                                                             12000, cudaEnableDefault, &found);
    if (err != cudaSuccess) return err;
    if (found != cudaDriverEntryPointSuccess || entry == nullptr) return cudaErrorNotSupported;
    cached = reinterpret_cast<EncodeTiledFn>(entry);
  }
  *fn = cached;
  return cudaSuccess;
}

// A [rows][width] byte matrix (row stride `width` bytes) read as [128 rows][128 B] boxes with
// the 128-byte swizzle.
cudaError_t encode_byte_tiles(EncodeTiledFn encode, CUtensorMap* map, const void* base,
                              uint64_t width, uint64_t rows) {
  const cuuint64_t dims[2] = {width, rows};
  const cuuint64_t strides[1] = {width};
  const cuuint32_t box[2] = {128, 128};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims,
                            strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The kernel's launch checks and shared memory size, once per instantiation.
template <typename OutT, bool kSplit>
cudaError_t prepare(int smem_bytes) {
  auto* kernel = &sage_sm90_kernel<OutT, kSplit>;
  cudaFuncAttributes attributes;
  cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);  // no image at all: an error
  if (err != cudaSuccess) return err;
  // An image JIT-compiled from older PTX (compute_80/89) has the trapping body: refuse it.
  if (attributes.ptxVersion < 90) return cudaErrorNoKernelImageForDevice;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

template <typename OutT>
cudaError_t launch_typed(const SageSm90Params& p, cudaStream_t stream, bool programmatic_launch) {
  const int64_t num_m_blocks = (p.shape.seq_q + kBlockM - 1) / kBlockM;
  const int64_t blocks = num_m_blocks * p.shape.batch * p.shape.heads;
  if (p.splits < 1 || p.split_first > blocks || (p.splits == 1 && p.split_first != blocks) ||
      (p.splits > 1 && (p.partials == nullptr || p.counters == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const int smem_bytes = static_cast<int>(sizeof(SharedStorage)) + 1024;  // + alignment slack
  cudaError_t err;
  if ((err = prepare<OutT, false>(smem_bytes)) != cudaSuccess) return err;
  if (p.splits > 1 && (err = prepare<OutT, true>(smem_bytes)) != cudaSuccess) return err;
  EncodeTiledFn encode = nullptr;
  if ((err = encode_tiled_function(&encode)) != cudaSuccess) return err;
  CUtensorMap q_map, k_map, v_map;
  const uint64_t q_rows = static_cast<uint64_t>(p.shape.batch) * p.shape.heads * p.shape.seq_q;
  const uint64_t kv_heads = static_cast<uint64_t>(p.shape.batch) * p.shape.kv_heads;
  if ((err = encode_byte_tiles(encode, &q_map, p.q_int8, kSageHeadDim, q_rows)) != cudaSuccess ||
      (err = encode_byte_tiles(encode, &k_map, p.k_int8, kSageHeadDim,
                               kv_heads * p.shape.seq_kv_pad)) != cudaSuccess ||
      (err = encode_byte_tiles(encode, &v_map, p.v_fp8, p.shape.seq_kv_pad,
                               kv_heads * kSageHeadDim)) != cudaSuccess) {
    return err;
  }
  // The whole query blocks, then (same stream: after them) the split parts of the rest. Only
  // the first launch is a programmatic dependent: the split parts run after the whole blocks.
  const auto launch = [&](auto kernel, unsigned grid, bool programmatic) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    config.stream = stream;
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = programmatic ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, p, q_map, k_map, v_map);
  };
  if (p.split_first > 0) {
    err = launch(&sage_sm90_kernel<OutT, false>, static_cast<unsigned>(p.split_first),
                 programmatic_launch);
    if (err != cudaSuccess) return err;
  }
  if (p.splits > 1 && blocks > p.split_first) {
    const unsigned parts = static_cast<unsigned>((blocks - p.split_first) * p.splits);
    err = launch(&sage_sm90_kernel<OutT, true>, parts, programmatic_launch && p.split_first == 0);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_sage_attention_sm90(const SageSm90Params& params, SageOutKind out_kind,
                                       cudaStream_t stream, bool programmatic_launch) {
  return out_kind == SageOutKind::kBFloat16
             ? launch_typed<__nv_bfloat16>(params, stream, programmatic_launch)
             : launch_typed<__half>(params, stream, programmatic_launch);
}

}  // namespace attention
}  // namespace omni
