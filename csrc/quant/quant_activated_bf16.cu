// __nv_bfloat16 instantiation of the GELU-fused quantization launcher (see quant_kernel.cuh); a file of
// its own so that it compiles in parallel with the per-token launcher's.
#include "quant_kernel.cuh"

namespace omni {
namespace quant {

template void launch_quantize_activated<__nv_bfloat16>(const Params&, int64_t, OutKind, int, int,
                                                       cudaStream_t);

}  // namespace quant
}  // namespace omni
