// __half instantiation of the fused QK-RMSNorm + RoPE launcher (see qk_norm_rope_kernel.cuh).
#include "qk_norm_rope_kernel.cuh"

namespace omni {
namespace qk_norm_rope {

template void launch_qk_rmsnorm_rope<__half>(const Params&, int64_t, int, bool, bool, int,
                                              cudaStream_t);

}  // namespace qk_norm_rope
}  // namespace omni
