"""Quantized linear layers: :func:`quantized_linear` and the module :class:`QuantizedLinear`.

A W8A8 layer (``"fp8"``, ``"int8"``) quantizes its input per token on every call
(:func:`omni_kernels.quant.quantize_per_token`, or fused with a GELU:
:func:`omni_kernels.quant.quantize_activated_per_token`) and multiplies the two 8-bit
operands (:func:`omni_kernels.quant.gemm.scaled_mm`); a weight-only layer multiplies its
input as it is with the 8-bit weight (:func:`omni_kernels.quant.gemm.weight_only_mm`).

``activation_backend="auto"`` quantizes with the custom kernel op in eager mode and with
plain torch ops under ``torch.compile``, so Inductor fuses the quantization with whatever
produces the layer's input; ``"split"`` (opt-in) chooses per layer under ``torch.compile``
by the input width (:func:`resolve_activation_backend`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from omni_kernels._triton import eager_launch_allowed
from omni_kernels.quant.activated import check_prefix, quantize_activated_per_token
from omni_kernels.quant.dispatch import (
    CUDA_STAGED_MAX_ROW,
    QUANTIZE_BACKENDS,
    fp8_unsupported_reason,
    quantize_per_token,
)
from omni_kernels.quant.gemm import quantize_weight, resolve_fast_accum, scaled_mm, weight_only_mm
from omni_kernels.quant.gemm_backends import (
    LINEAR_BACKENDS,
    SCALED_MM_ALIGNMENT,
    WEIGHT_ONLY_BACKENDS,
    _cublaslt_device_reason,
    _cublaslt_failed,
)
from omni_kernels.quant.gemm_ops import _HAS_FUSED_FP8_OP
from omni_kernels.quant.methods import METHOD_DTYPES, QUANT_METHODS
from omni_kernels.quant.reference import FP8_DTYPE, INPUT_ACTIVATIONS

logger = logging.getLogger(__name__)

#: ``activation_backend`` values of a W8A8 layer: :data:`QUANTIZE_BACKENDS` and ``"split"``.
ACTIVATION_BACKENDS = (*QUANTIZE_BACKENDS, "split")
# Inductor fuses the quantization of narrow inputs (K=3072) with their LayerNorm/modulation but
# splits a wide cat + GELU input (K=15360) into two passes; the threshold between is a guess
# (bench/pipeline.py's "split" variant times it).
DEFAULT_SPLIT_K = 8192

# ('fused_fp8', gemm) pairs already logged
_logged_auto_choices: set[tuple] = set()


def check_split_k(split_k, activation_backend: str, owner: str = "split_k") -> int | None:
    """Validate ``split_k`` (``None`` or an int >= 0, only with ``activation_backend="split"``);
    returns it with ``None`` resolved to :data:`DEFAULT_SPLIT_K` for ``"split"``."""
    if split_k is None:
        return DEFAULT_SPLIT_K if activation_backend == "split" else None
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 0:
        raise ValueError(f"{owner} must be None or an int >= 0 (an input width K); got {split_k!r}")
    if activation_backend != "split":
        raise ValueError(
            f"{owner}={split_k} applies only to activation_backend='split'; "
            f"got activation_backend={activation_backend!r}"
        )
    return split_k


def resolve_activation_backend(activation_backend: str, k: int | None = None,
                               split_k: int | None = None) -> str:
    """The :func:`quantize_per_token` backend a W8A8 layer with input width ``k`` runs.

    ``"auto"`` while ``torch.compile`` traces is ``"torch"``; ``"split"`` while it
    traces is ``"torch"`` for ``k <= split_k`` (default :data:`DEFAULT_SPLIT_K`) and
    ``"auto"`` (the kernels' own choice: omni's CUDA or Triton op, the torch ops
    only where neither can take the input) above; in eager mode both are
    ``"auto"``. Any other value is itself.

    Under ``torch.compile`` the CUDA and Triton kernels are opaque custom ops:
    Inductor must write their input (the LayerNorm + adaLN modulation or the
    GELU before the layer) in bfloat16, and the kernel reads it back and writes
    it again in 8 bits. The ``"torch"`` backend is the reference's plain torch
    ops (per-row absolute maximum, scale, clamp, round/cast: exactly
    :func:`~omni_kernels.quant.reference.quantize_per_token_reference`), which
    Inductor fuses into the kernel that produces the input. In eager mode
    ``"auto"`` keeps the custom kernels (the reference is a slow float32 path there).

    Inductor does not fuse every producer equally well: a wide input built by a
    ``cat`` and a GELU (Flux's single blocks' ``proj_out``, K=15360) was split into
    two passes over it, more than the kernel's one read of the materialized
    input. ``"split"`` gives such wide layers the kernel and keeps the fused torch
    ops for the narrow ones.
    """
    if activation_backend == "split":
        if k is None:
            raise ValueError("activation_backend='split' needs the layer's input width k")
        if not torch.compiler.is_compiling():
            return "auto"
        split_k = DEFAULT_SPLIT_K if split_k is None else split_k
        return "torch" if k <= split_k else "auto"
    if activation_backend == "auto" and torch.compiler.is_compiling():
        return "torch"
    return activation_backend


def activated_quantize_backend(activation_backend: str) -> str:
    """The :func:`~omni_kernels.quant.quantize_activated_per_token` backend of a layer whose
    ``activation_backend`` is this: ``"cuda"``, ``"triton"`` and ``"torch"`` as they are;
    ``"auto"`` and ``"split"`` are ``"auto"`` in eager mode and under ``torch.compile`` alike
    (the fused kernel reads the pre-activation once, which is what Inductor's own fusion of a
    wide GELU and quantization did not manage)."""
    if activation_backend in ("auto", "split"):
        return "auto"
    if activation_backend in ("cuda", "torch", "triton"):
        return activation_backend
    raise ValueError(
        f"input_activation: the activation-fused quantization has CUDA, Triton and torch backends; "
        f"activation_backend={activation_backend!r} (allowed with it: 'auto', 'split', 'cuda', 'triton', 'torch')"
    )


def quantized_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    method: str,
    *,
    backend: str = "auto",
    activation_backend: str = "auto",
    clamp: float | None = None,
    fast_accum: bool | str = "auto",
    split_k: int | None = None,
    input_activation: str | None = None,
    activation_from: int = 0,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """``nn.Linear`` on ``x`` ``[..., K]`` with a quantized weight; output in ``x``'s dtype.

    ``method`` is one of :data:`QUANT_METHODS`; W8A8 methods quantize ``x`` per
    token first (with ``clamp`` and ``activation_backend``, which
    :func:`resolve_activation_backend` resolves with ``K`` and ``split_k``: plain
    torch ops under ``torch.compile`` for ``"auto"``). With ``input_activation``
    (W8A8 only), the layer computes ``linear(activated(x))``:
    :func:`~omni_kernels.quant.quantize_activated_per_token` applies it to the
    columns ``activation_from:`` of ``x`` in the quantization pass.

    ``prefix`` ``[..., K0]`` (``x``'s leading shape, dtype and device) makes the input
    ``cat([prefix, x], -1)``, the result that of this function on it. When the activation
    starts right after the prefix (``input_activation`` set, ``activation_from == K0``), the
    quantization reads the two in place and the ``cat`` is never materialized; otherwise it is.
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"method must be one of {QUANT_METHODS}; got {method!r}")
    if prefix is not None:
        check_prefix(prefix, x)
        if input_activation is None or activation_from != prefix.shape[-1]:
            x, prefix = torch.cat([prefix, x], -1), None
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (a reshape is a dispatched call even when a no-op)
    if input_activation is not None:
        if method.endswith("_weight_only"):
            raise ValueError(f"input_activation needs a W8A8 method; got method {method!r}")
        if prefix is not None:
            # The activation covers all of x; the prefix passes through (see quantize_activated_per_token).
            prefix, activation_from = prefix.reshape(x2.shape[0], prefix.shape[-1]), 0
        x_q, x_scale = quantize_activated_per_token(
            x2, w_q.dtype, activation=input_activation, activation_from=activation_from, clamp=clamp,
            backend=activated_quantize_backend(activation_backend), prefix=prefix,
        )
        out = scaled_mm(x_q, x_scale, w_q, w_scale, bias, x.dtype, backend=backend, fast_accum=fast_accum)
    elif method.endswith("_weight_only"):
        out = weight_only_mm(x2, w_q, w_scale, bias, backend=backend)
    elif (gemm := fused_fp8_eager_gemm(x2, w_q, w_scale, bias, backend, activation_backend)) is not None:
        if ("fused_fp8", gemm) not in _logged_auto_choices:
            _logged_auto_choices.add(("fused_fp8", gemm))
            logger.info("quantized_linear (fp8) in eager mode: one op, omni's CUDA per-token "
                        "quantization then the FP8 GEMM %r (omni_kernels::quantized_linear_fp8)", gemm)
        args = (x2, w_q, w_scale, bias, float(clamp) if clamp is not None else 0.0, resolve_fast_accum(fast_accum, k))
        try:
            out = torch.ops.omni_kernels.quantized_linear_fp8(*args, gemm)
        except RuntimeError as error:
            if backend != "auto" or gemm == "aten":
                raise
            _cublaslt_failed(x2.device, error)
            out = torch.ops.omni_kernels.quantized_linear_fp8(*args, "aten")
    else:
        x_q, x_scale = quantize_per_token(
            x2, w_q.dtype, clamp=clamp, backend=resolve_activation_backend(activation_backend, k, split_k)
        )
        out = scaled_mm(x_q, x_scale, w_q, w_scale, bias, x.dtype, backend=backend, fast_accum=fast_accum)
    return out if x.dim() == 2 else out.reshape(*lead, w_q.shape[0])


def fused_fp8_eager_gemm(
    x2: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    backend: str, activation_backend: str,
) -> str | None:
    """The ``gemm`` argument with which an eager FP8 W8A8 call on ``x2`` ``[M, K]`` may run as the
    one op ``torch.ops.omni_kernels.quantized_linear_fp8`` (omni's CUDA per-token quantization,
    then the FP8 GEMM, from C++), or ``None`` where it may not. The op runs exactly what the
    two-call path's choices run there (the CUDA op's staged kernel, then the GEMM ``backend``
    resolves to: ``"cublaslt_tuned"`` for ``"cublaslt"``, ``"aten"`` for ``"aten"``), for one
    dispatched call instead of two with their Python checks (an eager FP8 layer at Flux's
    shapes is bound by host time).

    Needs: eager mode without dispatch modes on plain tensors, the compiled extension, CUDA
    bfloat16 ``x2`` with 16-byte aligned rows, ``K <= CUDA_STAGED_MAX_ROW``, ``K`` and ``N``
    multiples of 16, a GPU with FP8 tensor cores, a bias in bfloat16 or none, ``backend``
    ``"auto"``, ``"cublaslt"`` or ``"aten"``, and ``activation_backend`` naming the CUDA kernel
    (``"auto"``, ``"cuda"`` or ``"split"``, which are that kernel in eager mode)."""
    if backend not in ("auto", "cublaslt", "aten") or activation_backend not in ("auto", "cuda", "split"):
        return None
    # First: under torch.compile or a dispatch mode the tensors may be fake (no data_ptr).
    if not _HAS_FUSED_FP8_OP or not eager_launch_allowed(x2, w_q, w_scale, bias):
        return None
    if x2.dtype != torch.bfloat16 or not x2.is_cuda or w_q.dtype != FP8_DTYPE:
        return None
    k, n = x2.shape[1], w_q.shape[0]
    # Anything the op would refuse takes the two-call path, whose checks raise ValueError.
    if w_q.dim() != 2 or w_q.shape[1] != k or k > CUDA_STAGED_MAX_ROW or k % SCALED_MM_ALIGNMENT or n % SCALED_MM_ALIGNMENT:
        return None
    if x2.shape[0] == 0 or x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,)):
        return None
    if w_scale.dtype != torch.float32 or w_scale.numel() != n or not w_scale.is_contiguous():
        return None
    if fp8_unsupported_reason(x2.device) is not None:
        return None
    if backend == "aten":
        return "aten"
    # (CUDA, FP8, bfloat16 output, K and N: checked above)
    if _cublaslt_device_reason(x2.device, backend == "auto") is None:
        return "cublaslt_tuned"
    # "cublaslt" asked for and refused: the two-call path raises the reason.
    return "aten" if backend == "auto" else None


# --------------------------------------------------------------------------- module


class QuantizedLinear(nn.Module):
    """A drop-in replacement of ``nn.Linear`` (inference only) holding an 8-bit weight.

    State: ``qweight`` ``[out, in]`` (``torch.float8_e4m3fn`` or ``torch.int8``)
    and ``weight_scale`` ``[out]`` float32 buffers, and ``bias`` (a parameter
    without grad, in the model dtype) if the layer has one; these names are the
    ``state_dict`` keys. ``module.to(dtype)`` / ``.half()`` convert the bias
    only: the 8-bit weight and its float32 scales keep their dtypes.

    Output dtype = input dtype. W8A8 methods (``"fp8"``, ``"int8"``) quantize
    the input per token on every call; weight-only methods do not. ``backend`` is one
    of :data:`LINEAR_BACKENDS`, for weight-only methods one of :data:`WEIGHT_ONLY_BACKENDS`
    (``"triton_gemv"`` then needs at most 16 input rows).
    ``activation_backend`` is one of :data:`ACTIVATION_BACKENDS`; ``split_k``
    (``None``: :data:`DEFAULT_SPLIT_K`) is the widest input that
    ``activation_backend="split"`` quantizes with torch ops under ``torch.compile``
    (:func:`resolve_activation_backend`); it is an error with any other backend.
    ``input_activation`` (W8A8 only; ``None`` or one of
    :data:`~omni_kernels.quant.reference.INPUT_ACTIVATIONS`) makes the layer compute
    ``linear(activated(x))``, the activation applied to the input columns
    ``activation_from:`` inside the quantization pass (:func:`quantized_linear`):
    :func:`omni_diffusion.quantization.quantize` sets it on the layers that read a
    GELU's output and removes that GELU module.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        method: str = "fp8",
        *,
        device=None,
        dtype: torch.dtype | None = None,
        backend: str = "auto",
        activation_backend: str = "auto",
        clamp: float | None = None,
        fast_accum: bool | str = "auto",
        split_k: int | None = None,
        input_activation: str | None = None,
        activation_from: int = 0,
    ) -> None:
        super().__init__()
        if method not in QUANT_METHODS:
            raise ValueError(f"method must be one of {QUANT_METHODS}; got {method!r}")
        allowed = WEIGHT_ONLY_BACKENDS if method.endswith("_weight_only") else LINEAR_BACKENDS
        if backend not in allowed or (backend == "cublaslt" and method != "fp8"):
            allowed = tuple(b for b in allowed if b != "cublaslt" or method == "fp8")
            raise ValueError(f"backend must be one of {allowed} for method {method!r}; got {backend!r}")
        if activation_backend not in ACTIVATION_BACKENDS:
            raise ValueError(f"activation_backend must be one of {ACTIVATION_BACKENDS}; got {activation_backend!r}")
        self.split_k = check_split_k(split_k, activation_backend)
        self.set_input_activation(input_activation, activation_from, method=method, in_features=in_features,
                                  activation_backend=activation_backend)
        self.in_features = in_features
        self.out_features = out_features
        self.method = method
        self.backend = backend
        self.activation_backend = activation_backend
        self.clamp = clamp
        resolve_fast_accum(fast_accum, in_features)  # validates
        self.fast_accum = fast_accum
        qdtype = METHOD_DTYPES[method]
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=qdtype, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(out_features, dtype=dtype or torch.float32, device=device), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str, **options) -> QuantizedLinear:
        """Quantize ``linear``'s weight per output channel into a new module on its device."""
        weight = linear.weight
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None, method,
            device=weight.device, dtype=weight.dtype, **options,
        )
        q, scale = quantize_weight(weight, METHOD_DTYPES[method])
        module.qweight.copy_(q)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def set_input_activation(self, activation: str | None, activation_from: int = 0, *, method: str | None = None,
                             in_features: int | None = None, activation_backend: str | None = None) -> None:
        """Set (or, with ``None``, clear) the activation applied to the input columns
        ``activation_from:`` before quantization; ``ValueError`` for a weight-only layer, an
        unknown activation, a column outside ``[0, in_features)`` or ``activation_backend="cuda"``."""
        method = method or self.method
        in_features = in_features if in_features is not None else self.in_features
        if activation is not None:
            if activation not in INPUT_ACTIVATIONS:
                raise ValueError(f"input_activation must be None or one of {INPUT_ACTIVATIONS}; got {activation!r}")
            if method.endswith("_weight_only"):
                raise ValueError(f"input_activation needs a W8A8 method; got method {method!r}")
            activated_quantize_backend(activation_backend or self.activation_backend)
        if isinstance(activation_from, bool) or not isinstance(activation_from, int) or not (
            0 <= activation_from < max(in_features, 1)
        ):
            raise ValueError(f"activation_from must be an int in [0, in_features={in_features}); got {activation_from!r}")
        self.input_activation = activation
        self.activation_from = activation_from if activation is not None else 0

    @property
    def weight_only(self) -> bool:
        return self.method.endswith("_weight_only")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._quantized_linear(x)

    def _quantized_linear(self, x: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        return quantized_linear(
            x, self.qweight, self.weight_scale, self.bias, self.method, backend=self.backend,
            activation_backend=self.activation_backend, clamp=self.clamp, fast_accum=self.fast_accum,
            split_k=self.split_k, input_activation=self.input_activation, activation_from=self.activation_from,
            prefix=prefix,
        )

    def forward_concat(self, head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """``self(torch.cat([head, tail], -1))``, the same values, for ``head`` ``[..., K0]`` and
        ``tail`` ``[..., in_features - K0]`` (same leading shape, dtype and device).

        A W8A8 layer whose ``input_activation`` starts at column ``K0`` (Flux's single blocks'
        ``proj_out`` on ``cat(attention output, proj_mlp output)``) quantizes the two in place,
        the ``cat`` never written (:func:`quantized_linear`'s ``prefix``); any other layer
        concatenates and runs :meth:`forward`'s path on the ``cat``.
        """
        return self._quantized_linear(tail, prefix=head)

    def forward_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """W8A8 on an input already quantized (``[..., K]`` and ``[..., 1]``), e.g. by a
        norm/adaLN-fused :func:`~omni_kernels.quant.quantize_per_token`, which then
        replaces this layer's own quantization pass."""
        if self.weight_only:
            raise ValueError(f"forward_quantized needs a W8A8 method; this layer is {self.method!r}")
        if self.input_activation is not None:
            raise ValueError(
                f"forward_quantized takes an input already quantized, but this layer applies "
                f"{self.input_activation!r} to its input before quantizing it"
            )
        if x_q.dtype != self.qweight.dtype:
            raise ValueError(f"x_q must be {self.qweight.dtype} for method {self.method!r}; got {x_q.dtype}")
        lead, k = x_q.shape[:-1], x_q.shape[-1]
        out = scaled_mm(
            x_q.reshape(-1, k), x_scale.reshape(-1, 1), self.qweight, self.weight_scale, self.bias,
            out_dtype, backend=self.backend, fast_accum=self.fast_accum,
        )
        return out.reshape(*lead, self.out_features)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``qweight * weight_scale[:, None]`` in ``dtype`` (for inspection and tests)."""
        return (self.qweight.float() * self.weight_scale[:, None]).to(dtype)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) converts every floating-point tensor, and float8 counts as one:
        # keep the 8-bit weight and the float32 scales in their dtypes (only devices change).
        before = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, method={self.method!r}, backend={self.backend!r}"
            + (f", activation_backend='split', split_k={self.split_k}" if self.activation_backend == "split" else "")
            + (f", input_activation={self.input_activation!r}"
               + (f", activation_from={self.activation_from}" if self.activation_from else "")
               if self.input_activation is not None else "")
        )
