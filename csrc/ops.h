// Host entry points of omni_kernels._C, one per op registered in torch_bindings.cpp.
#pragma once

#include <optional>

#include <torch/all.h>

// Fused QK-RMSNorm + rotary embedding (csrc/qk_norm_rope/). Writes q_out and k_out.
void qk_rmsnorm_rope(torch::Tensor& q_out, torch::Tensor& k_out, const torch::Tensor& q,
                     const torch::Tensor& k, const std::optional<torch::Tensor>& q_weight,
                     const std::optional<torch::Tensor>& k_weight, const torch::Tensor& cos,
                     const torch::Tensor& sin, double eps, bool interleaved,
                     bool norm_across_heads);
