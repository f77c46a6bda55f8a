// __half instantiation of the GELU-fused quantization launcher (see quant_kernel.cuh); a file of
// its own so that it compiles in parallel with the per-token launcher's.
#include "quant_kernel.cuh"

namespace omni {
namespace quant {

template void launch_quantize_activated<__half>(const Params&, int64_t, OutKind, int, int,
                                                cudaStream_t);

}  // namespace quant
}  // namespace omni
