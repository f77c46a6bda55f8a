// __half instantiation of the per-token quantization launcher (see quant_kernel.cuh).
#include "quant_kernel.cuh"

namespace omni {
namespace quant {

template void launch_quantize_per_token<__half>(const Params&, int64_t, NormKind, OutKind, int,
                                                int, cudaStream_t);

}  // namespace quant
}  // namespace omni
