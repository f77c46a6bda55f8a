"""omni's Triton kernels (quantization, GEMM, halo, QK-norm+RoPE, flash and quantized attention) pass Triton's compiler front end for sm_90, on the CPU.

The interpreter (how CI runs the kernels) executes the Python source and accepts what the
compiler refuses, e.g. a plain module-level float read inside a kernel: a GELU constant did
that, passed every CPU test and failed to compile on the H200. Lowering each kernel to
Triton IR (no GPU, no ptxas) catches that class of error here. It runs in a subprocess
without ``TRITON_INTERPRET`` (under it ``@triton.jit`` gives interpreted functions, which the
compiler cannot call).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

_QUANT_CONSTANTS = dict(QMAX=448.0, IS_INT8=False, MIN_AMAX=1e-12, USE_LIBDEVICE=True)
_ACTIVATED_ARGS = {"x_ptr": "*bf16", "p_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32",
                   "prefix_width": "i32", "activation_from": "i32", "x_row_stride": "i32", "p_row_stride": "i32",
                   "q_row_stride": "i32", "clamp_val": "fp32"}
_PER_TOKEN_ARGS = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "w_ptr": "*bf16", "b_ptr": "*bf16",
                   "ms_ptr": "*bf16", "mt_ptr": "*bf16", "K": "i32", "x_row_stride": "i32", "q_row_stride": "i32",
                   "mod_row_stride": "i32", "rows_per_group": "i32", "eps": "fp32", "clamp_val": "fp32",
                   "p_ptr": "*bf16", "p_row_stride": "i32", "sample_rows": "i32", "prefix_rows": "i32"}

# activated_concat: the prefix read through its own pointer (Flux's proj_out input without its cat).
# -recompute: the single-tile path that applies the GELU again for the store.
CASES = {
    f"activated{'_concat' if prefix else ''}-{q}-{'tile' if tile else 'chunked'}{'-recompute' if recompute else ''}": (
        "omni_kernels.quant.activated_triton_kernel", "_quantize_activated_kernel",
        {**_ACTIVATED_ARGS, "q_ptr": "*i8" if q == "int8" else "*fp8e4nv"},
        dict(_QUANT_CONSTANTS, IS_INT8=q == "int8", QMAX=127.0 if q == "int8" else 448.0, HAS_CLAMP=True,
             HAS_PREFIX=prefix, BLOCK_P=4096 if prefix else 16, BLOCK_K=16384 if tile else 4096, SINGLE_TILE=tile,
             RECOMPUTE=recompute))
    for prefix in (False, True) for q in ("fp8", "int8") for tile in (True, False)
    for recompute in ((False, True) if tile else (False,))
}
# per_token_prefix: the joint sequence's text rows read through their own pointer (no cat).
CASES.update({
    f"per_token{'_prefix' if prefix else ''}-norm{norm}-{'tile' if tile else 'chunked'}": (
        "omni_kernels.quant.triton_kernel", "_quantize_per_token_kernel", _PER_TOKEN_ARGS,
        dict(_QUANT_CONSTANTS, NORM=norm, HAS_W=True, HAS_B=norm == 2, HAS_MOD_SCALE=True, HAS_MOD_SHIFT=True,
             HAS_CLAMP=False, BLOCK_K=4096, SINGLE_TILE=tile, HAS_PREFIX=prefix))
    for prefix in (False, True) for norm in ((0, 1, 2) if not prefix else (2,)) for tile in (True, False)
})


_GEMM_ARGS = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
              "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_ak": "i32",
              "stride_bn": "i32", "stride_bk": "i32", "stride_cm": "i32", "stride_cn": "i32"}
CASES.update({
    f"scaled_gemm-{kind}": (
        "omni_kernels.quant.triton_gemm", "_scaled_gemm_kernel",
        {**_GEMM_ARGS, **({"a_ptr": "*i8", "b_ptr": "*i8"} if kind == "int8" else {})},
        dict(HAS_A_SCALE=True, HAS_BIAS=True, B_TO_A=False, INT_ACC=kind == "int8", EVEN_K=False,
             IEEE_FP32=False, FAST_ACCUM=kind == "fp8-fast", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8))
    for kind in ("fp8", "fp8-fast", "int8")
})
_HALO_DIMS = {name: "i32" for name in ("T", "NT", "H", "W", "sxn", "sxt", "sxh", "sxw")}
CASES["halo_pack"] = ("omni_kernels.halo.triton_kernel", "_halo_pack_kernel",
                      {"x_ptr": "*bf16", "lo_ptr": "*bf16", "hi_ptr": "*bf16", "N_LO": "i32", "N_HI": "i32",
                       **_HALO_DIMS}, dict(BLOCK_W=256))
CASES.update({
    f"halo_assemble-modes{lo}{hi}": (
        "omni_kernels.halo.triton_kernel", "_halo_assemble_kernel",
        {"x_ptr": "*bf16", "lo_ptr": "*bf16", "hi_ptr": "*bf16", "out_ptr": "*bf16", "LO": "i32", "HI": "i32",
         **_HALO_DIMS, **{name: "i32" for name in ("son", "sot", "soh", "sow")}},
        dict(LO_MODE=lo, HI_MODE=hi, RECV=0, ZERO=1, BLOCK_W=256))
    for lo, hi in ((0, 1), (2, 0))
})


_QK_ARGS = {name: "*bf16" for name in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "q_weight_ptr", "k_weight_ptr")}
_QK_ARGS.update({"cos_ptr": "*fp32", "sin_ptr": "*fp32", "eps": "fp32"})
_QK_ARGS.update({name: "i32" for name in (
    "seq_len", "heads_q", "heads_k", "q_stride_b", "q_stride_s", "q_stride_h", "k_stride_b", "k_stride_s",
    "k_stride_h", "q_out_stride_b", "q_out_stride_s", "q_out_stride_h", "k_out_stride_b", "k_out_stride_s",
    "k_out_stride_h")})
CASES.update({
    f"qk_norm_rope-{'interleaved' if interleaved else 'halves'}-{'across' if across else 'per_head'}": (
        "omni_kernels.qk_norm_rope.triton_kernel", "_qk_rmsnorm_rope_kernel", _QK_ARGS,
        dict(HAS_Q_WEIGHT=True, HAS_K_WEIGHT=True, NORM_ACROSS_HEADS=across, BLOCK_HQ=32, BLOCK_HK=32,
             HALF_D=64, BLOCK_D=128, INTERLEAVED=interleaved, COMPUTE_DTYPE=triton.language.float32))
    for interleaved in (True, False) for across in (True, False)
})


# Attention without TMA descriptors (None: a constexpr); the TMA variants need descriptor types.
_FLASH_ARGS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "LSE": "*fp32", "KEY_LENGTHS": "*i32",
               "qk_scale": "fp32"}
_FLASH_ARGS.update({name: "i32" for name in (
    "stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
    "stride_vn", "stride_ob", "stride_oh", "stride_om", "num_heads", "num_kv_heads", "seq_q", "seq_k",
    "num_m_blocks")})
CASES.update({
    f"flash_attention-{'causal' if causal else 'full'}-{'pipelined' if pipeline else 'plain'}": (
        "omni_kernels.attention.triton_flash", "_attn_fwd_kernel", _FLASH_ARGS,
        dict(q_desc=None, k_desc=None, v_desc=None, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64,
             CAUSAL=causal, HAS_KEY_LENGTHS=True, RETURN_LSE=True, USE_TMA=False, TMA_BSHD=False, FP32=False,
             PIPELINE_QK=pipeline, WARP_SPECIALIZE=False))
    for causal in (False, True) for pipeline in (False, True)
})
_SAGE_ARGS = {"Q8": "*i8", "QS": "*fp32", "QKMEAN": "*fp32", "K8": "*i8", "KS": "*fp32", "VT8": "*fp8e4nv",
              "VS": "*fp32", "Out": "*bf16", "LSE": "*fp32", "KEY_LENGTHS": "*i32", "scale": "fp32",
              "qk_scale": "fp32"}
_SAGE_ARGS.update({name: "i32" for name in (
    "stride_ob", "stride_oh", "stride_om", "num_heads", "num_kv_heads", "seq_q", "seq_k", "seq_k_pad",
    "num_m_blocks")})
CASES.update({
    f"sage_attention{'-score-bias' if bias else ''}{'-pdl' if pdl else ''}": (
        "omni_kernels.attention.quantized.attention_kernel", "_sage_fwd_kernel", _SAGE_ARGS,
        dict(q_desc=None, k_desc=None, v_desc=None, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, HAS_KEY_LENGTHS=True,
             RETURN_LSE=True, USE_TMA=False, EMULATE_FP8=False, WARP_SPECIALIZE=False, SCORE_BIAS=bias,
             USE_PDL=pdl))
    for bias, pdl in ((False, False), (True, False), (False, True))
})
# the quantizer of the quantized attention, with and without its grid dependency control (PDL)
_SAGE_QUANT_ARGS = {name: "*bf16" for name in ("Q", "K", "V")}
_SAGE_QUANT_ARGS.update({"Q8": "*i8", "QS": "*fp32", "QKMEAN": "*fp32", "KMEAN": "*fp32", "K8": "*i8",
                         "KS": "*fp32", "VT8": "*fp8e4nv", "VS": "*fp32", "KEY_LENGTHS": "*i32"})
_SAGE_QUANT_ARGS.update({name: "i32" for name in (
    "stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
    "stride_vn", "num_heads", "num_kv_heads", "seq_q", "seq_k", "seq_k_pad", "num_q_blocks", "num_q_programs",
    "num_blocks", "num_kv_programs")})
_K_MEAN_ARGS = {"K": "*bf16", "KMEAN": "*fp32", "KEY_LENGTHS": "*i32"}
_K_MEAN_ARGS.update({name: "i32" for name in ("stride_kb", "stride_kh", "stride_kn", "num_kv_heads", "seq_k")})
CASES.update({
    f"sage_quantize_codes{'-pdl' if pdl else ''}": (
        "omni_kernels.attention.quantized.quantize", "_qkv_quant_kernel", _SAGE_QUANT_ARGS,
        dict(HEAD_DIM=128, Q_BLOCK=64, BLOCK_N=128, EMULATE_FP8=False, HAS_KEY_LENGTHS=True, PERMUTE_V=True,
             USE_PDL=pdl))
    for pdl in (False, True)
})
CASES.update({
    f"sage_quantize_k_mean{'-pdl' if pdl else ''}": (
        "omni_kernels.attention.quantized.quantize", "_k_mean_kernel", _K_MEAN_ARGS,
        dict(HEAD_DIM=128, BLOCK_S=256, SAMPLES=512, HAS_KEY_LENGTHS=True, USE_PDL=pdl))
    for pdl in (False, True)
})


def _lower_to_ttir(module_name: str, kernel_name: str, arg_types: dict, constexprs: dict) -> str:
    import importlib

    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(module_name), kernel_name)
    signature = {**arg_types, **{name: "constexpr" for name in constexprs}}
    assert set(signature) == set(kernel.arg_names), set(kernel.arg_names) ^ set(signature)
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    return str(source.make_ir(target, options, backend.get_codegen_implementation(options),
                              backend.get_module_map(), context))


def test_kernels_lower_to_triton_ir_for_sm90():
    """Every case in one subprocess (importing torch and triton once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__, *sorted(CASES)], env=env, capture_output=True,
                            text=True, timeout=300)
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    failed = {case: error for case, error in outcome.items() if error != "ok"}
    assert sorted(outcome) == sorted(CASES) and not failed, "\n\n".join(f"{c}: {e}" for c, e in failed.items())


if __name__ == "__main__":
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError as exc:
        print(f"this triton has no CUDA front end: {exc}")
        sys.exit(3)
    outcome = {}
    for case in sys.argv[1:]:
        try:
            ttir = _lower_to_ttir(*CASES[case])
            outcome[case] = "ok" if "tt.func" in ttir and "tt.store" in ttir else f"no kernel in the IR: {ttir[:500]}"
            if outcome[case] == "ok" and case.endswith("-pdl") and "griddepcontrol" not in ttir:
                outcome[case] = "no griddepcontrol in the IR of a USE_PDL=True case"
        except Exception as exc:  # reported per case by the test
            outcome[case] = f"{type(exc).__name__}: {exc}"[-2000:]
    print(json.dumps(outcome))
