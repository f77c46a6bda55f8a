// __half instantiation of the shared-memory-staged quantization launcher (see
// quant_staged_kernel.cuh); a file of its own so that it compiles in parallel with the others.
#include "quant_staged_kernel.cuh"

namespace omni {
namespace quant {

template void launch_quantize_staged<__half>(const Params&, int64_t, OutKind, bool, int, cudaStream_t);

}  // namespace quant
}  // namespace omni
