"""FP8/INT8 quantization of the linear layers of a diffusers transformer, in place.

    from omni_diffusion.quantization import QuantConfig, quantize, save_quantized, load_quantized

    config = QuantConfig(method="fp8", skip=("x_embedder", "context_embedder", "proj_out"))
    quantize(transformer, config)            # swaps nn.Linear -> QuantizedLinear, in place
    save_quantized(transformer, "flux-fp8.safetensors")
    ...
    load_quantized(fresh_transformer, "flux-fp8.safetensors")   # same layers, no re-quantizing

The model stays an ordinary ``nn.Module`` (a ``ModelMixin`` stays one): only
its ``nn.Linear`` children are replaced by
:class:`omni_kernels.quant.QuantizedLinear`, whose ``state_dict`` holds
``qweight`` (8-bit), ``weight_scale`` (float32, per output channel) and ``bias``.

Which layers are quantized (:func:`plan_quantization`), for each ``nn.Linear`` by name:

1. a ``skip`` pattern matches the layer or one of its parents (``fnmatch``,
   ``*`` crosses dots: ``"time_text_embed"`` keeps every linear under it,
   ``"*.proj_out"`` every block's ``proj_out``) -> kept in full precision;
2. ``include`` is given and no pattern matches it -> kept;
3. ``min(in_features, out_features) < min_features`` -> kept (too small to gain);
4. ``in_features`` or ``out_features`` not a multiple of 16 (what
   ``torch._scaled_mm`` and every 8-bit tensor-core GEMM here needs) -> kept,
   with the reason logged; an error instead when an ``include`` pattern names
   the layer (the caller asked for that very layer);
5. otherwise quantized, with the method of the first ``layer_methods`` pattern
   that matches the layer or one of its parents (same matching as ``skip``), else
   ``method``: e.g. ``layer_methods={"*.norm1.linear": "int8_weight_only"}`` gives
   Flux's adaLN modulation linears (one input row per sample, a GEMV) 8-bit weights
   only while every other layer is FP8 W8A8. :func:`save_quantized` records each
   layer's method and :func:`load_quantized` rebuilds it.

Projections that read one input (an attention's ``to_q``/``to_k``/``to_v``,
and its ``add_q/k/v_proj`` over the text) can be fused before quantizing
(``QuantConfig.fuse_projections``, on by default for W8A8): where the model
family's adapter declares them (:attr:`omni_diffusion.adapters.base.ModelAdapter.fusable_attention`),
the attention module's own diffusers ``fuse_projections()`` builds ``to_qkv``
(``to_added_qkv``), the three separate layers are removed, and the fused layer
is quantized, so one activation quantization and one GEMM serve q, k and v. A
triple is fused only when all three layers would be quantized (a ``skip`` or
``include`` pattern naming one of them keeps the three separate). Fusing
changes no number: per-token activation scales depend on the shared input
only, per-output-channel weight scales on their own row. Tensor parallelism
(:mod:`omni_diffusion.parallel`) shards the separate ``to_q/k/v`` first
(``accelerate()`` orders it so); fusing then concatenates this rank's shards,
whose ``chunk(3)`` are this rank's heads of q, k and v, so the two compose.

A GELU whose output one W8A8 layer alone reads (a DiT's MLP down projection;
Flux's and HunyuanVideo's single blocks' ``proj_out``, which reads
``cat(attention, GELU(proj_mlp(x)))``) is folded into that layer
(``QuantConfig.fuse_activations``, on by default for W8A8), where the adapter
declares it (:attr:`omni_diffusion.adapters.base.ModelAdapter.activation_fusions`):
the GELU module goes (``nn.GELU`` becomes ``nn.Identity``; diffusers' ``GELU``
becomes :class:`GELUProjection`, its ``proj`` alone) and the layer applies the
GELU in its quantization pass (``QuantizedLinear.input_activation``,
:func:`omni_kernels.quant.quantize_activated_per_token`), so the GELU's output
is never written in 16 bits. The GELU is computed in float32 and quantized
without rounding it to bfloat16 first (the unfused path rounds it once).

Likewise a block's LayerNorm + adaLN modulation output that only W8A8 layers read
(a DiT block's attention and MLP inputs) is quantized once, in omni's norm/adaLN-fused
kernel, where the adapter declares the block
(:attr:`~omni_diffusion.adapters.base.ModelAdapter.norm_fusions`,
``QuantConfig.fuse_norms``, on by default for W8A8): the block gets a forward that
computes the norm, modulation and per-token quantization in one pass and gives the
8-bit tensor to every layer reading it (``QuantizedLinear.forward_quantized``),
instead of writing the modulated output in 16 bits and quantizing it once per
reader (under ``torch.compile``, in a kernel Inductor writes).

A ``skip`` or ``include`` pattern that matches no module at all, or a
``layer_methods`` pattern that matches no linear layer, raises ``ValueError`` (a
typo would otherwise silently quantize a layer meant to stay bf16, or with the
wrong method). There are no per-model defaults in this module (``DEFAULT_SKIP`` is
empty): which layers of Flux, SD3, Wan or Qwen-Image stay in full precision is
measured per family and passed in by the caller (the runtime's model adapters).
Typical choices keep the input embedders, the timestep/text embedders and the
final projection (``proj_out``) in bf16.

FP8 needs FP8 tensor cores (CUDA compute capability >= 8.9): :func:`quantize`
raises ``RuntimeError`` for an FP8 method on a model that sits on an older GPU;
a model quantized on CPU and moved to such a GPU raises ``ValueError`` at its
first forward, with the same explanation. On CPU every method runs (torch's CPU
kernels: for tests and reference only).
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import inspect
import json
import logging
import math
import os
import types
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from omni_kernels.quant import (
    LINEAR_BACKENDS,
    QUANT_METHODS,
    SCALED_MM_ALIGNMENT,
    QuantizedLinear,
    fp8_unsupported_reason,
    quantize_per_token,
)
from omni_kernels.quant.linear import ACTIVATION_BACKENDS, check_split_k

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter

logger = logging.getLogger(__name__)

# No model-specific defaults here: callers (the runtime's model adapters) pass the measured
# skip list of their model family.
DEFAULT_SKIP: tuple[str, ...] = ()
_FORMAT = "omni-quant/1"
_METADATA_FORMAT_KEY = "omni_quant_format"
_METADATA_LAYERS_KEY = "omni_quant_layers"
_METADATA_CONFIG_KEY = "omni_quant_config"
_METADATA_FUSED_KEY = "omni_quant_fused_attention"
_METADATA_ACTIVATIONS_KEY = "omni_quant_fused_activations"
# Where quantize() records the GELUs it folded into their consumers (module.__dict__).
_ACTIVATION_RECORD_ATTR = "_omni_fused_activations"
# Where it records the owners given a concat-free forward: [(name, function)] (module.__dict__).
_CONCAT_FREE_RECORD_ATTR = "_omni_concat_free_forwards"
# Where it records the blocks given a norm-fused forward: [(name, function)] (module.__dict__).
_NORM_FUSED_RECORD_ATTR = "_omni_norm_fused_forwards"
# Where a block given a norm-fused forward keeps its class forward, for that forward's fallback.
_CLASS_FORWARD_ATTR = "_omni_class_forward"
# The projections diffusers' fuse_projections() merges: fused layer, then its members in output order.
_FUSED_PROJECTIONS = (
    ("to_qkv", ("to_q", "to_k", "to_v")),
    ("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")),
)
# Where quantize() records the attention modules it fused (module.__dict__, not a submodule).
_FUSION_RECORD_ATTR = "_omni_fused_attention"


@dataclass(frozen=True)
class QuantConfig:
    """How :func:`quantize` quantizes a model; validated on construction (``ValueError``).

    Attributes:
        method: ``"fp8"`` (FP8 e4m3 weights and per-token activations, W8A8),
            ``"int8"`` (INT8 W8A8), ``"fp8_weight_only"`` or ``"int8_weight_only"``
            (8-bit weights, activations as they are: saves memory, not compute).
        layer_methods: per-layer exceptions to ``method``: ``(fnmatch pattern, method)``
            pairs (a dict ``{pattern: method}`` or a list of pairs is accepted and
            stored as a tuple of pairs, in order); a quantized layer takes the method
            of the first pattern matching it or one of its parents, else ``method``.
            ``skip``, ``include`` and ``min_features`` still decide which layers are
            quantized (a pattern naming only kept layers is logged as a warning). A
            pattern matching no linear layer raises at :func:`quantize`. Projections
            are fused only when their three layers get the same method. Through
            :class:`omni_diffusion.AccelConfig`: ``quant_options={"layer_methods": {...}}``.
        skip: ``fnmatch`` patterns of module names kept in full precision (a
            pattern naming a parent keeps all linears under it). Default: none.
        include: ``None`` (every ``nn.Linear``) or patterns naming the only
            layers to quantize; a named layer the kernels cannot take is an error.
        min_features: layers whose ``min(in_features, out_features)`` is below
            this stay in full precision. Default 0 (callers pass the measured
            per-family value).
        backend: GEMM backend of the quantized layers: ``"auto"``, ``"aten"``,
            ``"cublaslt"`` (FP8 W8A8 only), ``"triton"`` or ``"torch"`` (see
            :mod:`omni_kernels.quant.linear`).
        activation_backend: activation quantization backend: ``"auto"``,
            ``"cuda"``, ``"triton"``, ``"torch"`` or ``"split"`` (below).
        split_k: with ``activation_backend="split"`` only: the widest input
            (``in_features``) quantized with torch ops under ``torch.compile``;
            wider inputs use omni's kernel op. ``None`` (default): 8192
            (``omni_kernels.quant.linear.DEFAULT_SPLIT_K``); an error with any
            other ``activation_backend``.
        clamp: ``None``, or clip activations to ``[-clamp, clamp]`` before their
            per-token scale is taken (W8A8 only).
        fast_accum: FP8 W8A8 accumulation: ``True`` (Hopper's fast, reduced-precision
            accumulation over all of K), ``False`` (promoted to float32 after every MMA)
            or ``"auto"`` (fast only up to ``K = 8192``, measured: see
            ``omni_kernels.quant.linear.FAST_ACCUM_MAX_K``).
        fuse_projections: fuse the attention projections that read one input
            (q/k/v, and the added text q/k/v) into one layer each before
            quantizing, where the model's adapter declares them (module
            docstring): one activation quantization and one GEMM instead of
            three, the same numbers. ``None`` (default): on for the W8A8
            methods, off for weight-only ones (no activation quantization to
            save). Not yet timed on a GPU: ``bench/pipeline.py`` rows (d) and
            (d0) compare the two.
        fuse_activations: fold the GELUs the model's adapter declares
            (module docstring) into the W8A8 layer reading their output. ``None``
            (default): on for W8A8 methods; ``True`` with a weight-only method is
            an error.
        fuse_norms: give the blocks the model's adapter declares (module docstring) a
            forward that quantizes each LayerNorm + adaLN output once, in omni's fused
            kernel, for all the W8A8 layers reading it. ``None`` (default): on for W8A8
            methods; ``True`` with a weight-only method is an error.

    ``activation_backend="auto"`` runs omni's CUDA/Triton kernel in eager mode
    and, under ``torch.compile``, the reference's plain torch ops, which Inductor
    fuses into the kernel producing the layer's input (the LayerNorm + adaLN
    modulation, the GELU) instead of writing that input in 16 bits and reading it
    back; ``"torch"`` asks for the torch ops in eager mode too (slow there: the
    float32 reference), ``"cuda"``/``"triton"`` for the kernel under compile too.
    ``"split"`` (opt-in, not yet timed: ``bench/pipeline.py`` row (d2) against (d))
    is ``"auto"`` in eager mode and picks per layer under compile: the fused torch
    ops for ``in_features <= split_k``, the kernel op (which reads the materialized
    16-bit input once) above, for wide inputs that Inductor fuses poorly (an H200
    profile of Flux: the K=15360 ``proj_out`` input of the single blocks took two
    passes).
    """

    method: str = "fp8"
    skip: tuple[str, ...] = field(default=DEFAULT_SKIP)
    include: tuple[str, ...] | None = None
    min_features: int = 0
    backend: str = "auto"
    activation_backend: str = "auto"
    clamp: float | None = None
    fast_accum: bool | str = "auto"
    fuse_projections: bool | None = None
    split_k: int | None = None
    fuse_activations: bool | None = None
    fuse_norms: bool | None = None
    layer_methods: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ValueError(f"QuantConfig.method must be one of {QUANT_METHODS}; got {self.method!r}")
        object.__setattr__(self, "layer_methods", normalize_layer_methods(self.layer_methods))
        object.__setattr__(self, "skip", _patterns("skip", self.skip))
        if self.include is not None:
            object.__setattr__(self, "include", _patterns("include", self.include))
        if isinstance(self.min_features, bool) or not isinstance(self.min_features, int) or self.min_features < 0:
            raise ValueError(f"QuantConfig.min_features must be an int >= 0; got {self.min_features!r}")
        if self.backend not in LINEAR_BACKENDS:
            raise ValueError(f"QuantConfig.backend must be one of {LINEAR_BACKENDS}; got {self.backend!r}")
        other_methods = sorted({m for m in (self.method, *(m for _, m in self.layer_methods)) if m != "fp8"})
        if self.backend == "cublaslt" and other_methods:
            raise ValueError(
                f"QuantConfig.backend='cublaslt' is omni's FP8 W8A8 GEMM; it cannot run method(s) {other_methods} "
                f"(use backend 'auto', which picks per layer)"
            )
        if self.activation_backend not in ACTIVATION_BACKENDS:
            raise ValueError(
                f"QuantConfig.activation_backend must be one of {ACTIVATION_BACKENDS}; "
                f"got {self.activation_backend!r}"
            )
        check_split_k(self.split_k, self.activation_backend, "QuantConfig.split_k")
        if self.clamp is not None:
            if isinstance(self.clamp, bool) or not isinstance(self.clamp, (int, float)) or not (
                math.isfinite(self.clamp) and self.clamp > 0
            ):
                raise ValueError(f"QuantConfig.clamp must be None or a finite number > 0; got {self.clamp!r}")
            object.__setattr__(self, "clamp", float(self.clamp))
        if not (isinstance(self.fast_accum, bool) or self.fast_accum == "auto"):
            raise ValueError(f"QuantConfig.fast_accum must be True, False or 'auto'; got {self.fast_accum!r}")
        if self.fuse_projections is not None and not isinstance(self.fuse_projections, bool):
            raise ValueError(
                f"QuantConfig.fuse_projections must be True, False or None (on for W8A8 methods); "
                f"got {self.fuse_projections!r}"
            )

        if self.fuse_activations is not None and not isinstance(self.fuse_activations, bool):
            raise ValueError(
                f"QuantConfig.fuse_activations must be True, False or None (on for W8A8 methods); "
                f"got {self.fuse_activations!r}"
            )
        if self.fuse_activations and self.weight_only:
            raise ValueError(
                f"QuantConfig.fuse_activations=True needs a W8A8 method (it folds a GELU into the "
                f"activation quantization); got method {self.method!r}"
            )

        if self.fuse_norms is not None and not isinstance(self.fuse_norms, bool):
            raise ValueError(
                f"QuantConfig.fuse_norms must be True, False or None (on for W8A8 methods); got {self.fuse_norms!r}"
            )
        if self.fuse_norms and self.weight_only:
            raise ValueError(
                f"QuantConfig.fuse_norms=True needs a W8A8 method (it quantizes the norm output for "
                f"W8A8 layers); got method {self.method!r}"
            )

    @property
    def weight_only(self) -> bool:
        """Whether ``method`` (the default method) is weight-only."""
        return self.method.endswith("_weight_only")

    def method_for(self, name: str) -> str:
        """The method of linear layer ``name``: the first matching ``layer_methods`` pattern's, else ``method``."""
        return next((m for pattern, m in self.layer_methods if _matches(name, pattern)), self.method)

    @property
    def fuses_activations(self) -> bool:
        """``fuse_activations`` with ``None`` resolved (module docstring)."""
        if self.fuse_activations is not None:
            return self.fuse_activations
        return not self.weight_only

    @property
    def fuses_norms(self) -> bool:
        """``fuse_norms`` with ``None`` resolved (on for W8A8 methods)."""
        return self.fuse_norms if self.fuse_norms is not None else not self.weight_only

    @property
    def fuses_projections(self) -> bool:
        """``fuse_projections`` with ``None`` resolved (on for W8A8 methods)."""
        return self.fuse_projections if self.fuse_projections is not None else not self.weight_only

    @classmethod
    def from_dict(cls, data: dict) -> QuantConfig:
        """Build from a plain dict (e.g. parsed JSON/YAML); unknown keys raise ``ValueError``."""
        if isinstance(data, QuantConfig):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"QuantConfig.from_dict needs a dict; got {type(data).__name__}")
        allowed = tuple(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(f"QuantConfig: unknown field(s) {unknown}; allowed fields are {allowed}")
        return cls(**data)

    def to_dict(self) -> dict:
        """A JSON-serializable dict that :meth:`from_dict` turns back into this config."""
        data = dataclasses.asdict(self)
        data["layer_methods"] = [list(pair) for pair in self.layer_methods]
        data["skip"] = list(self.skip)
        data["include"] = list(self.include) if self.include is not None else None
        return data

    def layer_options(self) -> dict:
        """The :class:`QuantizedLinear` keyword options this config sets."""
        return dict(
            backend=self.backend, activation_backend=self.activation_backend, clamp=self.clamp,
            fast_accum=self.fast_accum, split_k=self.split_k,
        )


def normalize_layer_methods(value) -> tuple[tuple[str, str], ...]:
    """``layer_methods`` as a tuple of ``(pattern, method)`` pairs; ``ValueError`` naming the bad entry."""
    if isinstance(value, dict):
        value = list(value.items())
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(
            f"QuantConfig.layer_methods must be a dict {{pattern: method}} or a list of (pattern, method) "
            f"pairs; got {value!r}"
        )
    pairs = []
    for entry in value:
        if isinstance(entry, str) or not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise ValueError(f"QuantConfig.layer_methods entries must be (pattern, method) pairs; got {entry!r}")
        pattern, method = entry
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"QuantConfig.layer_methods patterns must be non-empty strings; got {pattern!r}")
        if method not in QUANT_METHODS:
            raise ValueError(
                f"QuantConfig.layer_methods[{pattern!r}] must be one of {QUANT_METHODS}; got {method!r}"
            )
        pairs.append((pattern, method))
    return tuple(pairs)


def _patterns(name: str, value) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(
            f"QuantConfig.{name} must be a list or tuple of fnmatch patterns (strings); got {value!r}"
        )
    for pattern in value:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"QuantConfig.{name} patterns must be non-empty strings; got {pattern!r}")
    return tuple(value)


@dataclass(frozen=True)
class LayerPlan:
    """What :func:`quantize` does with one ``nn.Linear``: ``action`` is ``"quantize"`` or ``"keep"``."""

    name: str
    action: str
    reason: str
    in_features: int
    out_features: int
    method: str | None = None  # the layer's method (QuantConfig.method_for) when quantized


def _matches(name: str, pattern: str) -> bool:
    """True when ``pattern`` matches ``name`` or one of its parents (``a.b`` for ``a.b.c``)."""
    parts = name.split(".") if name else [""]
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def _unmatched(patterns, names) -> list[str]:
    return [p for p in patterns if not any(_matches(n, p) for n in names)]


def _shape_problem(linear: nn.Linear) -> str | None:
    bad = [
        f"{what}={value}"
        for what, value in (("in_features", linear.in_features), ("out_features", linear.out_features))
        if value % SCALED_MM_ALIGNMENT
    ]
    if bad:
        return f"{' and '.join(bad)} not a multiple of {SCALED_MM_ALIGNMENT} (8-bit GEMMs need it)"
    return None


def plan_quantization(module: nn.Module, config: QuantConfig) -> list[LayerPlan]:
    """The decision for every ``nn.Linear`` of ``module``, in module order (see the module docstring).

    Raises:
        ValueError: a ``skip``/``include`` pattern matches no module, a ``layer_methods``
            pattern no linear layer, or an ``include``d layer has a shape the kernels cannot take.
    """
    config = QuantConfig.from_dict(config)
    all_names = [name for name, _ in module.named_modules()]
    linear_names = [name for name, child in module.named_modules() if isinstance(child, nn.Linear)]
    model = type(module).__name__
    for field_name, patterns, names, what in (
        ("skip", config.skip, all_names, "module"),
        ("include", config.include or (), all_names, "module"),
        ("layer_methods", [pattern for pattern, _ in config.layer_methods], linear_names, "linear layer"),
    ):
        missing = _unmatched(patterns, names)
        if missing:
            examples = ", ".join(repr(n) for n in names[1 if names is all_names else 0:][:5])
            raise ValueError(
                f"QuantConfig.{field_name} pattern(s) {missing} match no {what} of {model} "
                f"({what} names look like {examples}, ...)"
            )
    plans = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.Linear):
            continue
        sizes = dict(in_features=child.in_features, out_features=child.out_features)
        skip = next((p for p in config.skip if _matches(name, p)), None)
        if skip is not None:
            plans.append(LayerPlan(name, "keep", f"matches skip pattern {skip!r}", **sizes))
            continue
        included = None
        if config.include is not None:
            included = next((p for p in config.include if _matches(name, p)), None)
            if included is None:
                plans.append(LayerPlan(name, "keep", "matches no include pattern", **sizes))
                continue
        smallest = min(child.in_features, child.out_features)
        if smallest < config.min_features:
            plans.append(LayerPlan(name, "keep", f"min(in, out) = {smallest} < min_features {config.min_features}", **sizes))
            continue
        problem = _shape_problem(child)
        if problem is not None:
            if included is not None:
                raise ValueError(
                    f"layer {name!r} of {model} (named by include pattern {included!r}) cannot be "
                    f"quantized: {problem}"
                )
            plans.append(LayerPlan(name, "keep", problem, **sizes))
            continue
        if not child.weight.is_floating_point():
            plans.append(LayerPlan(name, "keep", f"weight dtype {child.weight.dtype} is not floating point", **sizes))
            continue
        method = config.method_for(name)
        plans.append(LayerPlan(name, "quantize", method, **sizes, method=method))
    return plans


def _warn_idle_layer_methods(plans: list[LayerPlan], config: QuantConfig) -> None:
    """Warn about ``layer_methods`` patterns whose layers are all kept in full precision (by
    ``skip``, say: a family adapter's skip list wins over the caller's methods)."""
    for pattern, method in config.layer_methods:
        named = [p for p in plans if _matches(p.name, pattern)]
        if named and all(p.action == "keep" for p in named):
            logger.warning("quantize: QuantConfig.layer_methods pattern %r (%s) changes nothing: every layer it "
                           "names is kept in full precision (%s: %s)", pattern, method, named[0].name,
                           named[0].reason)


def _check_hardware(module: nn.Module, plans: list[LayerPlan], config: QuantConfig) -> None:
    first_fp8 = {}  # device -> the first plan asking FP8 of a layer there
    for plan in plans:
        if plan.action == "quantize" and plan.method.startswith("fp8"):
            first_fp8.setdefault(module.get_submodule(plan.name).weight.device, plan)
    for device in sorted(first_fp8, key=str):
        reason = fp8_unsupported_reason(device)
        if reason is not None:
            plan = first_fp8[device]
            asked = (f"QuantConfig.method={config.method!r}" if plan.method == config.method else
                     f"QuantConfig.layer_methods gives {plan.name!r} {plan.method!r}")
            raise RuntimeError(f"{asked}: {reason}")


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


# --------------------------------------------------------------------------- projection fusion


@dataclass
class _FusedAttention:
    """One attention module whose projections :func:`quantize` fused, and what it changed."""

    name: str
    processor: Any  # the processor before fusion
    own_flag: bool  # whether ``fused_projections`` was an instance attribute before
    flag: Any
    # attn's submodule names in their order before fusion: unfusing puts the order back,
    # so named_modules() and state_dict() list them as before
    module_order: tuple[str, ...] = ()


def _resolve_adapter(module: nn.Module, adapter: ModelAdapter | None) -> ModelAdapter | None:
    if adapter is not None:
        return adapter
    from omni_diffusion.adapters import adapter_for_transformer

    try:
        return adapter_for_transformer(module)
    except ValueError:  # not a registered family: nothing declared to fuse
        return None


def _fusion_groups(attn: nn.Module) -> list[tuple[str, tuple[str, ...]]] | None:
    """The ``(fused name, members)`` pairs ``attn.fuse_projections()`` would build, or None
    when it cannot fuse ``attn`` the way the processors read it (not self-attention over one
    input, a triple incomplete or not plain linears of equal shapes)."""
    if not callable(getattr(attn, "fuse_projections", None)) or getattr(attn, "fused_projections", False):
        return None
    if getattr(attn, "is_cross_attention", False) or not getattr(attn, "_supports_qkv_fusion", True):
        return None
    groups = []
    for fused, members in _FUSED_PROJECTIONS:
        layers = [getattr(attn, m, None) for m in members]
        if all(layer is None for layer in layers) and fused != "to_qkv":
            continue
        if not all(isinstance(layer, nn.Linear) for layer in layers):
            return None
        if len({(layer.in_features, layer.out_features, layer.bias is not None) for layer in layers}) != 1:
            return None
        groups.append((fused, members))
    return groups


def plan_fusion(module: nn.Module, config: QuantConfig | dict, adapter: ModelAdapter | None = None,
                plans: list[LayerPlan] | None = None) -> list[str]:
    """The attention modules of ``module`` whose projections :func:`quantize` fuses, in module order.

    Those matching the adapter's ``fusable_attention`` patterns (``adapter``:
    a :class:`~omni_diffusion.adapters.base.ModelAdapter`; default the
    registered family of ``module``'s class, none: nothing is fused), whose
    q/k/v (and added q/k/v) layers :func:`plan_quantization` all quantizes, and
    for which the adapter has a processor that reads fused projections. A triple
    whose layers get different methods (``layer_methods``) is not fused. Empty
    when ``config.fuses_projections`` is off.
    """
    config = QuantConfig.from_dict(config)
    adapter = _resolve_adapter(module, adapter)
    if not config.fuses_projections or adapter is None or not adapter.fusable_attention:
        return []
    plans = plan_quantization(module, config) if plans is None else plans
    quantized = {p.name: p.method for p in plans if p.action == "quantize"}
    names = []
    for name, attn in module.named_modules():
        if not name or not any(fnmatch.fnmatchcase(name, p) for p in adapter.fusable_attention):
            continue
        groups = _fusion_groups(attn)
        if groups is None:
            continue
        if any(f"{name}.{m}" not in quantized for _, members in groups for m in members):
            continue
        methods = {(fused, quantized[f"{name}.{m}"]) for fused, members in groups for m in members}
        if len(methods) != len(groups):
            logger.debug("quantize: not fusing %s: layer_methods gives its projections different methods", name)
            continue
        if adapter.fused_attention_processor(attn) is None:
            logger.debug("quantize: not fusing %s: the %s adapter has no fused processor for %s",
                         name, adapter.name, type(getattr(attn, "processor", None)).__name__)
            continue
        names.append(name)
    return names


def _fuse_attention(module: nn.Module, name: str,
                    adapter: ModelAdapter | None) -> tuple[_FusedAttention, dict[str, nn.Module]]:
    """Fuse attention ``name``'s projections in place; returns the record and the removed layers."""
    attn = module.get_submodule(name)
    groups = _fusion_groups(attn)
    processor = adapter.fused_attention_processor(attn) if adapter is not None else None
    if groups is None or processor is None:
        why = ("no model adapter describes it" if adapter is None else
               "its q/k/v are not three plain linears of one shape" if groups is None else
               f"the {adapter.name!r} adapter has no processor that runs them fused")
        raise ValueError(
            f"cannot fuse the projections of {name} ({type(attn).__name__}, processor "
            f"{type(getattr(attn, 'processor', None)).__name__}): {why}"
        )
    record = _FusedAttention(name, attn.processor, "fused_projections" in attn.__dict__,
                             attn.__dict__.get("fused_projections"), tuple(attn._modules))
    with torch.no_grad():
        attn.fuse_projections()
    removed = {}
    for fused, members in groups:
        if not isinstance(getattr(attn, fused, None), nn.Linear):
            raise RuntimeError(f"{type(attn).__name__}.fuse_projections() built no {fused} for {name}")
        for member in members:
            removed[member] = attn._modules.pop(member)
    if processor is not attn.processor:
        attn.set_processor(processor)
    return record, removed


def _unfuse_attention(module: nn.Module, record: _FusedAttention,
                      removed: dict[str, nn.Module] | None = None) -> None:
    attn = module.get_submodule(record.name)
    for member, layer in (removed or {}).items():
        setattr(attn, member, layer)
    for fused, _ in _FUSED_PROJECTIONS:
        attn._modules.pop(fused, None)
    position = {child: i for i, child in enumerate(record.module_order)}
    children = sorted(attn._modules.items(), key=lambda item: position.get(item[0], len(position)))
    attn._modules.clear()
    attn._modules.update(children)
    if record.own_flag:
        attn.fused_projections = record.flag
    else:
        attn.__dict__.pop("fused_projections", None)
    if attn.processor is not record.processor:
        attn.set_processor(record.processor)


def _record_fusion(module: nn.Module, fused: list[tuple[_FusedAttention, dict]]) -> None:
    if fused:
        module.__dict__[_FUSION_RECORD_ATTR] = [
            *module.__dict__.get(_FUSION_RECORD_ATTR, []), *(record for record, _ in fused)
        ]


def fused_attention(module: nn.Module) -> list[str]:
    """The attention modules of ``module`` whose projections :func:`quantize` (or
    :func:`load_quantized`) fused."""
    return [record.name for record in module.__dict__.get(_FUSION_RECORD_ATTR, [])]


def unfuse_projections(module: nn.Module) -> None:
    """Take back the projection fusion :func:`quantize` did on ``module``: the fused
    layers are removed, each attention's ``fused_projections`` flag and processor are
    what they were. The separate q/k/v layers must be on their modules again first:
    :func:`quantize` releases them (like every replaced full-precision layer), and
    :func:`omni_diffusion.accelerate`'s undo puts its kept originals back before
    calling this.

    Raises:
        ValueError: a fused attention whose separate projections are not back.
    """
    records = module.__dict__.get(_FUSION_RECORD_ATTR, [])
    for record in records:
        attn = module.get_submodule(record.name)
        missing = [m for fused, members in _FUSED_PROJECTIONS if fused in attn._modules
                   for m in members if m not in attn._modules]
        if missing:
            raise ValueError(
                f"unfuse_projections: {record.name} has no {missing}: quantize() released the "
                "separate projections; only accelerate()'s undo keeps them"
            )
    for record in reversed(records):
        _unfuse_attention(module, record)
    module.__dict__.pop(_FUSION_RECORD_ATTR, None)


# --------------------------------------------------------------------------- activation fusion


class GELUProjection(nn.Module):
    """diffusers' ``GELU`` module (``proj`` then a GELU) without its GELU: the linear layer
    reading its output applies the GELU instead (``QuantizedLinear.input_activation``).
    ``proj`` keeps its name, so ``state_dict`` keys do not change."""

    def __init__(self, gelu: nn.Module) -> None:
        super().__init__()
        self.proj = gelu.proj
        self.approximate = gelu.approximate

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.proj(hidden_states)


@dataclass(frozen=True)
class _ActivationSite:
    """One GELU to fold: full module names and the consumer's first activated input column."""

    activation: str
    consumer: str
    activation_from: int


def _is_tanh_gelu(module: nn.Module) -> str | None:
    """``"module"`` for ``nn.GELU(approximate="tanh")``, ``"projection"`` for diffusers'
    ``GELU`` with ``approximate="tanh"`` (a ``proj`` linear then the GELU), else ``None``."""
    if isinstance(module, nn.GELU):
        return "module" if module.approximate == "tanh" else None
    names = {cls.__name__ for cls in type(module).__mro__}
    if "GELU" in names and getattr(module, "approximate", None) == "tanh" and isinstance(
        getattr(module, "proj", None), (nn.Linear, QuantizedLinear)
    ):
        return "projection"
    return None


def plan_activation_fusion(module: nn.Module, adapter: ModelAdapter | None) -> list[_ActivationSite]:
    """The GELUs of ``module`` that :func:`quantize` folds into the W8A8 layer reading them.

    For each of the adapter's :class:`~omni_diffusion.adapters.base.ActivationFusion`, every
    module of its owner class where the activation is a tanh GELU, the passthrough modules
    are dropouts or identities and the consumer is a W8A8 :class:`QuantizedLinear` (so run
    it after the layers are quantized) that applies no activation yet. Anything else is
    left as it is (logged at debug level).
    """
    if adapter is None or not adapter.activation_fusions:
        return []
    sites = []
    for owner_name, owner in module.named_modules():
        owner_classes = {cls.__name__ for cls in type(owner).__mro__}
        for fusion in adapter.activation_fusions:
            if fusion.owner_class not in owner_classes:
                continue
            prefix = f"{owner_name}." if owner_name else ""
            try:
                activation = owner.get_submodule(fusion.activation)
                consumer = owner.get_submodule(fusion.consumer)
                between = [owner.get_submodule(name) for name in fusion.passthrough]
                source = owner.get_submodule(fusion.concatenated_after) if fusion.concatenated_after else None
            except AttributeError as exc:
                logger.debug("quantize: not folding the GELU of %s: %s", owner_name, exc)
                continue
            why = (
                "the activation is not a tanh GELU" if _is_tanh_gelu(activation) is None else
                "a module between is not a dropout/identity"
                if not all(isinstance(m, (nn.Dropout, nn.Identity)) for m in between) else
                "its consumer is not a W8A8 QuantizedLinear"
                if not isinstance(consumer, QuantizedLinear) or consumer.weight_only else
                "its consumer already applies an activation" if consumer.input_activation is not None else
                None
            )
            activation_from = 0
            if why is None and source is not None:
                width = getattr(source, "out_features", None)
                activation_from = consumer.in_features - width if isinstance(width, int) else -1
                if not 0 < activation_from < consumer.in_features:
                    why = f"{fusion.concatenated_after} does not fill the end of the consumer's input"
            if why is not None:
                logger.debug("quantize: not folding %s%s into %s%s: %s", prefix, fusion.activation, prefix,
                             fusion.consumer, why)
                continue
            sites.append(_ActivationSite(prefix + fusion.activation, prefix + fusion.consumer, activation_from))
    return sites


def _fold_activation(module: nn.Module, site: _ActivationSite) -> None:
    activation = module.get_submodule(site.activation)
    kind = _is_tanh_gelu(activation)
    if kind is None:
        raise ValueError(f"cannot fold {site.activation}: a {type(activation).__name__}, not a tanh GELU")
    consumer = module.get_submodule(site.consumer)
    if not isinstance(consumer, QuantizedLinear):
        raise ValueError(f"cannot fold {site.activation} into {site.consumer}: not a QuantizedLinear")
    consumer.set_input_activation("gelu_tanh", site.activation_from)
    _replace(module, site.activation, nn.Identity() if kind == "module" else GELUProjection(activation))


def _record_activations(module: nn.Module, sites: list[_ActivationSite]) -> None:
    if sites:
        module.__dict__[_ACTIVATION_RECORD_ATTR] = [*module.__dict__.get(_ACTIVATION_RECORD_ATTR, []), *sites]


def install_concat_free_forwards(module: nn.Module, adapter: ModelAdapter | None) -> list[str]:
    """Give each owner of a folded, concatenated GELU its adapter's ``concat_free_forward``.

    For every :class:`~omni_diffusion.adapters.base.ActivationFusion` of ``adapter`` with
    one, each module of its owner class whose consumer is a :class:`QuantizedLinear`
    applying the GELU from exactly the column where ``concatenated_after``'s output
    starts gets that function as its instance ``forward`` (so its consumer reads the two
    inputs apart: no 16-bit ``cat``). Skipped, with a debug log: an owner that already
    has an instance ``forward`` (someone else's wrapper), or whose class ``forward`` takes
    other parameters than the function (a diffusers version it was not written for).
    Returns the owners' names; :func:`remove_concat_free_forwards` undoes it.
    """
    if adapter is None:
        return []
    installed: list[tuple[str, Any]] = []
    for fusion in adapter.activation_fusions:
        function = fusion.concat_free_forward
        if function is None or fusion.concatenated_after is None:
            continue
        wanted = list(inspect.signature(function).parameters)[1:]
        for name, owner in module.named_modules():
            if fusion.owner_class not in {cls.__name__ for cls in type(owner).__mro__}:
                continue
            try:
                consumer = owner.get_submodule(fusion.consumer)
                source = owner.get_submodule(fusion.concatenated_after)
            except AttributeError:
                continue
            # (a tensor-parallel consumer, say, is no QuantizedLinear: its GELU was not folded)
            folded = isinstance(consumer, QuantizedLinear) and consumer.input_activation is not None
            takes = list(inspect.signature(type(owner).forward).parameters)[1:]
            why = (
                "its consumer does not apply the folded GELU after the other input"
                if not folded or consumer.activation_from
                != consumer.in_features - getattr(source, "out_features", consumer.in_features) else
                "it already has an instance forward" if "forward" in owner.__dict__ else
                f"its forward takes {takes}, not {wanted}" if takes != wanted else
                None
            )
            if why is not None:
                logger.debug("quantize: %s keeps its forward (and its cat): %s", name, why)
                continue
            owner.forward = types.MethodType(function, owner)
            installed.append((name, function))
    if installed:
        module.__dict__[_CONCAT_FREE_RECORD_ATTR] = [*module.__dict__.get(_CONCAT_FREE_RECORD_ATTR, []), *installed]
    return [name for name, _ in installed]


def remove_concat_free_forwards(module: nn.Module) -> None:
    """Undo :func:`install_concat_free_forwards`: the owners' class ``forward`` again (an
    instance ``forward`` that is no longer the installed one is left alone)."""
    _remove_instance_forwards(module, _CONCAT_FREE_RECORD_ATTR)


def _remove_instance_forwards(module: nn.Module, record_attr: str) -> None:
    for name, function in module.__dict__.pop(record_attr, []):
        owner = module.get_submodule(name)
        current = owner.__dict__.get("forward")
        if getattr(current, "__func__", None) is function and getattr(current, "__self__", None) is owner:
            del owner.__dict__["forward"]


def w8a8_readers_unfit(*layers: nn.Module | None) -> str | None:
    """Why ``layers`` cannot share one quantized input, or ``None``: each must be a W8A8
    :class:`QuantizedLinear` applying no activation of its own, all with one weight dtype,
    ``clamp`` and ``activation_backend`` (their input quantization is then the same)."""
    first = None
    for layer in layers:
        if not isinstance(layer, QuantizedLinear) or layer.weight_only:
            return f"a reader is a {type(layer).__name__}{' (weight-only)' if isinstance(layer, QuantizedLinear) else ''}, not a W8A8 QuantizedLinear"
        if layer.input_activation is not None:
            return f"a reader applies {layer.input_activation!r} to its input"
        key = (layer.qweight.dtype, layer.clamp, layer.activation_backend)
        if first is None:
            first = key
        elif key != first:
            return f"the readers quantize their input differently ({first} vs {key})"
    return None if first is not None else "no reader"


def layer_norm_unfit(norm: nn.Module | None) -> str | None:
    """Why ``norm`` is not a LayerNorm over the last dim that omni's fused kernel computes, or ``None``."""
    if not isinstance(norm, nn.LayerNorm):
        return f"a {type(norm).__name__}, not a LayerNorm"
    if len(norm.normalized_shape) != 1:
        return f"a LayerNorm over {tuple(norm.normalized_shape)}, not over the last dim"
    return None


def quantize_modulated_norm(
    x: torch.Tensor, norm: nn.LayerNorm, shift: torch.Tensor, scale: torch.Tensor, reader: QuantizedLinear,
    prefix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reader``'s per-token quantization of ``norm(x) * (1 + scale) + shift``, in one pass.

    ``x`` ``[B, S, K]`` (16-bit or float32), ``shift``/``scale`` ``[B, K]`` (the adaLN
    modulation of each sample; any float dtype); ``norm`` a LayerNorm over K (with or
    without its affine); ``reader`` a W8A8 :class:`QuantizedLinear` whose weight dtype and
    ``clamp`` the quantization takes. Returns ``(codes [B, S, K], scales [B, S, 1] float32)``
    for ``reader.forward_quantized`` (and any other layer :func:`w8a8_readers_unfit`
    accepts with it). The kernel is omni's (Triton first under ``torch.compile``, where
    Inductor launches it: its point is the pass Inductor would otherwise write), unless the
    layer asks for ``activation_backend="torch"``.

    With ``prefix`` ``[B, P, K]`` the input is ``cat([prefix, x], 1)`` (a joint text + image
    sequence held as two tensors), read in place by the Triton kernel (the CUDA one cannot:
    ``auto`` takes Triton, and a layer asking for ``"cuda"`` gets the cat); the results then
    have ``P + S`` rows a sample.
    """
    backend = reader.activation_backend if reader.activation_backend in ("cuda", "triton", "torch") else "auto"
    if prefix is not None and backend == "cuda":
        prefix, x = None, torch.cat([prefix, x], dim=1)  # the CUDA kernel reads one tensor
    return quantize_per_token(
        x, reader.qweight.dtype, norm="layer", norm_weight=norm.weight, norm_bias=norm.bias, eps=norm.eps,
        mod_scale=scale, mod_shift=shift, clamp=reader.clamp, backend=backend, prefix=prefix,
    )


def install_norm_fused_forwards(module: nn.Module, adapter: ModelAdapter | None) -> list[str]:
    """Give each block of the adapter's :class:`~omni_diffusion.adapters.base.NormFusion`
    classes that its ``unfit`` accepts the fusion's ``forward`` as its instance ``forward``.

    Skipped, with a debug log: a block ``unfit`` names a reason for, one that already has an
    instance ``forward`` (someone else's wrapper), or one whose class ``forward`` takes other
    parameters than the function (a diffusers version it was not written for). Returns the
    blocks' names; :func:`remove_norm_fused_forwards` undoes it.
    """
    if adapter is None:
        return []
    installed: list[tuple[str, Any]] = []
    for fusion in adapter.norm_fusions:
        wanted = list(inspect.signature(fusion.forward).parameters)[1:]
        for name, owner in module.named_modules():
            if fusion.owner_class not in {cls.__name__ for cls in type(owner).__mro__}:
                continue
            takes = list(inspect.signature(type(owner).forward).parameters)[1:]
            why = (
                "it already has an instance forward" if "forward" in owner.__dict__ else
                f"its forward takes {takes}, not {wanted}" if takes != wanted else
                fusion.unfit(owner)
            )
            if why is not None:
                logger.debug("quantize: %s keeps its norm outputs in 16 bits: %s", name, why)
                continue
            owner.__dict__[_CLASS_FORWARD_ATTR] = type(owner).forward
            owner.forward = types.MethodType(fusion.forward, owner)
            installed.append((name, fusion.forward))
    if installed:
        module.__dict__[_NORM_FUSED_RECORD_ATTR] = [*module.__dict__.get(_NORM_FUSED_RECORD_ATTR, []), *installed]
    return [name for name, _ in installed]


def remove_norm_fused_forwards(module: nn.Module) -> None:
    """Undo :func:`install_norm_fused_forwards` (an instance ``forward`` that is no longer the
    installed one is left alone)."""
    for name, _ in module.__dict__.get(_NORM_FUSED_RECORD_ATTR, []):
        module.get_submodule(name).__dict__.pop(_CLASS_FORWARD_ATTR, None)
    _remove_instance_forwards(module, _NORM_FUSED_RECORD_ATTR)


def class_forward(block: nn.Module):
    """The class ``forward`` function of a block given a norm-fused forward (kept at install:
    ``torch.compile`` traces neither ``type(block).forward(block, ...)`` nor a walk of the MRO)."""
    return block.__dict__[_CLASS_FORWARD_ATTR]


def norm_fused_blocks(module: nn.Module) -> list[str]:
    """Names of the blocks of ``module`` given a norm-fused forward by :func:`quantize`."""
    return [name for name, _ in module.__dict__.get(_NORM_FUSED_RECORD_ATTR, [])]


def forget_folded_activations(module: nn.Module) -> None:
    """Drop ``module``'s record of folded GELUs, once the caller has put the GELU modules
    and their full-precision consumers back (``accelerate()``'s undo)."""
    module.__dict__.pop(_ACTIVATION_RECORD_ATTR, None)


def fused_activations(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{consumer: {"activation": name, "activation_from": column}}`` of the GELUs
    :func:`quantize` (or :func:`load_quantized`) folded into quantized layers of ``module``."""
    return {site.consumer: {"activation": site.activation, "activation_from": site.activation_from}
            for site in module.__dict__.get(_ACTIVATION_RECORD_ATTR, [])}


# --------------------------------------------------------------------------- quantize


def _swap_linear(module: nn.Module, name: str, method: str, options: dict,
                 on_released: Callable[[str, nn.Module], None] | None = None) -> nn.Module | None:
    """Replace linear ``name`` by its :class:`QuantizedLinear`; returns it when ``name`` is the root."""
    linear = module.get_submodule(name)
    with torch.no_grad():
        new = QuantizedLinear.from_linear(linear, method, **options)
    new.train(linear.training)
    if name:
        _replace(module, name, new)
        if on_released is not None:
            on_released(name, linear)
        return None
    return new


def quantize(module: nn.Module, config: QuantConfig | dict | None = None, *,
             adapter: ModelAdapter | None = None,
             on_released: Callable[[str, nn.Module], None] | None = None) -> nn.Module:
    """Quantize the ``nn.Linear`` layers of ``module`` in place; returns ``module``.

    Each chosen layer (:func:`plan_quantization`) is replaced by a
    :class:`QuantizedLinear` on the layer's device, its weight quantized per
    output channel and the full-precision weight released. ``config`` is a
    :class:`QuantConfig`, a dict for :meth:`QuantConfig.from_dict`, or ``None``
    (FP8, nothing skipped). If ``module`` is itself an ``nn.Linear``, the
    replacement is returned (it cannot be swapped in place).

    With ``config.fuses_projections``, the attention projections
    :func:`plan_fusion` names are fused first (module docstring), one attention
    at a time just before its fused layers are quantized; :func:`fused_attention`
    lists them afterwards. ``adapter``: the model family's
    :class:`~omni_diffusion.adapters.base.ModelAdapter` (default: looked up from
    ``module``'s class; none found: nothing is fused).

    ``on_released(name, layer)``, if given, is called with each full-precision linear as soon
    as it has left the model (its :class:`QuantizedLinear` is in place; for fused projections,
    the three separate layers once the fused one is quantized), so that a caller keeping the
    originals (:func:`omni_diffusion.accelerate`, for its undo) can move each one off the GPU
    at once: the model then never holds both precisions in full. (If ``quantize`` raises, the
    separate projections it fused are put back as they are then.)

    Raises:
        ValueError: a bad config, a pattern that matches no module, an included
            layer the kernels cannot take.
        RuntimeError: an FP8 method for a model on a GPU without FP8 tensor cores.
    """
    config = QuantConfig() if config is None else QuantConfig.from_dict(config)
    plans = plan_quantization(module, config)
    _warn_idle_layer_methods(plans, config)
    _check_hardware(module, plans, config)
    if config.fuses_projections or config.fuses_activations or config.fuses_norms:  # the family's declarations
        adapter = _resolve_adapter(module, adapter)
    fusing = plan_fusion(module, config, adapter, plans)
    method_of = {p.name: p.method for p in plans}
    member_of = {f"{a}.{m}": a for a in fusing for _, members in _fusion_groups(module.get_submodule(a))
                 for m in members}
    options = config.layer_options()
    replaced = None
    fused: list[tuple[_FusedAttention, dict[str, nn.Module]]] = []
    done: set[str] = set()
    try:
        for plan in plans:
            if plan.action != "quantize":
                logger.debug("quantize: keeping %s (%d -> %d) in full precision: %s",
                             plan.name or "<root>", plan.in_features, plan.out_features, plan.reason)
                continue
            attn_name = member_of.get(plan.name)
            if attn_name is None:
                replaced = _swap_linear(module, plan.name, plan.method, options, on_released) or replaced
                continue
            if attn_name in done:
                continue  # its fused layers are already quantized
            done.add(attn_name)
            fused.append(_fuse_attention(module, attn_name, adapter))
            attn = module.get_submodule(attn_name)
            for fused_name, members in _FUSED_PROJECTIONS:
                if fused_name in attn._modules:
                    # plan_fusion fuses only triples whose members share one method
                    method = method_of[f"{attn_name}.{members[0]}"]
                    # (the bf16 fused layer fuse_projections() built is dropped here, not released)
                    _swap_linear(module, f"{attn_name}.{fused_name}", method, options)
            if on_released is not None:
                for member, layer in fused[-1][1].items():
                    on_released(f"{attn_name}.{member}", layer)
    except BaseException:  # put the separate projections back: the caller may restore the rest
        for record, removed in reversed(fused):
            _unfuse_attention(module, record, removed)
        raise
    _record_fusion(module, fused)
    folded: list[_ActivationSite] = []
    if config.fuses_activations and replaced is None:
        sites = plan_activation_fusion(module, adapter)
        for site in sites:
            _fold_activation(module, site)
        _record_activations(module, sites)
        folded = sites
    norm_fused = install_norm_fused_forwards(module, adapter) if config.fuses_norms and replaced is None else []
    if config.fuse_norms and not norm_fused:  # asked for explicitly
        logger.warning(
            "quantize: fuse_norms=True, but no block of %s took a norm-fused forward (%s; debug logging "
            "says why each declared block did not)", type(module).__name__,
            "no model adapter" if adapter is None else
            f"the {adapter.name!r} adapter declares none" if not adapter.norm_fusions else
            f"the {adapter.name!r} adapter declares {', '.join(f.owner_class for f in adapter.norm_fusions)}",
        )
    if config.fuses_activations and replaced is None:
        install_concat_free_forwards(module, adapter)
    kept = [p for p in plans if p.action == "keep"]
    others = collections.Counter(p.method for p in plans if p.action == "quantize" and p.method != config.method)
    logger.info(
        "quantize: %s: %d of %d linear layers to %s%s%s%s%s; %d kept in full precision%s",
        type(module).__name__, len(plans) - len(kept), len(plans), config.method,
        f" ({', '.join(f'{n} to {m}' for m, n in others.items())} by layer_methods)" if others else "",
        f" ({len(fused)} attention modules' q/k/v fused)" if fused else "",
        f" ({len(folded)} GELUs folded into their consumers' quantization)" if folded else "",
        f" ({len(norm_fused)} blocks quantize their norm outputs in one fused kernel)" if norm_fused else "",
        len(kept),
        (" (" + "; ".join(f"{p.name}: {p.reason}" for p in kept[:8]) + ("; ..." if len(kept) > 8 else "") + ")")
        if kept else "",
    )
    return replaced if replaced is not None else module


def quantized_layers(module: nn.Module) -> dict[str, str]:
    """``{name: method}`` of the :class:`QuantizedLinear` layers of ``module``."""
    return {name: m.method for name, m in module.named_modules() if isinstance(m, QuantizedLinear)}


def save_quantized(module: nn.Module, path: str | os.PathLike, config: QuantConfig | dict | None = None) -> None:
    """Write ``module``'s whole ``state_dict`` (quantized and full-precision parts) to a safetensors file.

    The file's metadata records which layers are quantized and how, which
    attention modules have fused projections, which GELUs are folded into their
    consumers (and ``config``, when given), so
    :func:`load_quantized` rebuilds the same layers without quantizing anything.
    """
    layers = quantized_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} has no quantized layers: call quantize() before save_quantized()")
    from safetensors.torch import save_file

    metadata = {_METADATA_FORMAT_KEY: _FORMAT, _METADATA_LAYERS_KEY: json.dumps(layers)}
    if fused_attention(module):
        metadata[_METADATA_FUSED_KEY] = json.dumps(fused_attention(module))
    if fused_activations(module):
        metadata[_METADATA_ACTIVATIONS_KEY] = json.dumps(fused_activations(module))
    if config is not None:
        metadata[_METADATA_CONFIG_KEY] = json.dumps(QuantConfig.from_dict(config).to_dict())
    tensors = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, os.fspath(path), metadata=metadata)


def _unfused_name(name: str) -> str:
    """A fused projection's first member (``attn.to_qkv`` -> ``attn.to_q``); other names as they are."""
    parent, _, last = name.rpartition(".")
    for fused, members in _FUSED_PROJECTIONS:
        if last == fused:
            return f"{parent}.{members[0]}" if parent else members[0]
    return name


def _check_methods_match(config: QuantConfig, layers: dict[str, str], path: str) -> None:
    """``ValueError`` unless every layer of the file has the method ``config`` gives it."""
    wrong = {name: (method, config.method_for(_unfused_name(name))) for name, method in layers.items()
             if method != config.method_for(_unfused_name(name))}
    if not wrong:
        return
    if not config.layer_methods:
        raise ValueError(
            f"QuantConfig.method={config.method!r} does not match {path}, whose layers are "
            f"{sorted(set(layers.values()))}"
        )
    shown = "; ".join(f"{name}: file {got!r}, config {want!r}" for name, (got, want) in list(wrong.items())[:4])
    raise ValueError(
        f"QuantConfig (method={config.method!r}, layer_methods={list(config.layer_methods)}) does not "
        f"match {path} for {len(wrong)} layer(s): {shown}{'; ...' if len(wrong) > 4 else ''}"
    )


def load_quantized(
    module: nn.Module,
    path: str | os.PathLike,
    config: QuantConfig | dict | None = None,
    *,
    device: str | torch.device | None = None,
    adapter: ModelAdapter | None = None,
) -> nn.Module:
    """Load a file written by :func:`save_quantized` into ``module`` (the unquantized skeleton).

    The layers the file lists are replaced by :class:`QuantizedLinear` layers
    (no weight is quantized: the stored 8-bit weights and scales are loaded as
    they are), then the whole ``state_dict`` is loaded strictly, assigning the
    file's tensors (so a skeleton on the ``meta`` device works and never
    allocates the full-precision weights; non-persistent buffers, which no
    ``state_dict`` holds, must then be materialized by the caller). ``device``: where the tensors go;
    default the skeleton's device (CPU for ``meta``). ``config``: optional;
    its method (``method_for`` each layer: ``layer_methods`` included) must match the
    file's, its backend options apply to the layers
    (default: the options saved in the file, else the defaults). Attention
    modules the file has fused projections for are fused in ``module`` first,
    with ``adapter``'s processors (default: the adapter of ``module``'s class),
    and the GELUs it folded into their consumers are folded again.

    Raises:
        ValueError: not an omni quantized file, a config whose method differs,
            a listed layer that is not an ``nn.Linear`` of ``module``, or keys
            that do not match ``module``.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.fspath(path)
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get(_METADATA_FORMAT_KEY) != _FORMAT or _METADATA_LAYERS_KEY not in metadata:
        raise ValueError(f"{path} is not an omni quantized checkpoint (no {_METADATA_FORMAT_KEY!r} metadata)")
    layers: dict[str, str] = json.loads(metadata[_METADATA_LAYERS_KEY])
    saved_config = (
        QuantConfig.from_dict(json.loads(metadata[_METADATA_CONFIG_KEY]))
        if _METADATA_CONFIG_KEY in metadata else None
    )
    if config is not None:
        config = QuantConfig.from_dict(config)
        _check_methods_match(config, layers, path)
    options = (config or saved_config or QuantConfig()).layer_options()

    if device is None:
        first = next(iter(module.parameters()), None)
        device = first.device if first is not None and first.device.type != "meta" else torch.device("cpu")
    device = torch.device(device)
    model = type(module).__name__
    fused_names = json.loads(metadata.get(_METADATA_FUSED_KEY, "[]"))
    already = set(fused_attention(module))
    fused: list[tuple[_FusedAttention, dict[str, nn.Module]]] = []
    if fused_names:
        adapter = _resolve_adapter(module, adapter)
    targets = {}
    try:
        for name in fused_names:
            if name in already:
                continue
            try:
                module.get_submodule(name)
            except AttributeError:
                raise ValueError(f"{path} fuses the projections of {name!r}, which {model} does not have") from None
            fused.append(_fuse_attention(module, name, adapter))
        for name in layers:  # every listed layer is checked before anything is replaced
            try:
                targets[name] = module.get_submodule(name)
            except AttributeError:
                raise ValueError(f"{path} quantizes layer {name!r}, which {model} does not have") from None
            if not isinstance(targets[name], (nn.Linear, QuantizedLinear)):
                raise ValueError(
                    f"{path} quantizes {name!r}, which is a {type(targets[name]).__name__} in {model}, not nn.Linear"
                )
    except BaseException:
        for record, removed in reversed(fused):
            _unfuse_attention(module, record, removed)
        raise
    _record_fusion(module, fused)
    for name, method in layers.items():
        layer = targets[name]
        new = QuantizedLinear(
            layer.in_features, layer.out_features, layer.bias is not None, method, device="meta", **options
        )
        new.train(layer.training)
        _replace(module, name, new)

    sites = [_ActivationSite(entry["activation"], consumer, int(entry["activation_from"]))
             for consumer, entry in json.loads(metadata.get(_METADATA_ACTIVATIONS_KEY, "{}")).items()]
    for site in sites:
        try:
            _fold_activation(module, site)
        except AttributeError:
            raise ValueError(f"{path} folds {site.activation} into {site.consumer}, which {model} does not have") from None
    _record_activations(module, sites)
    adapter = _resolve_adapter(module, adapter)
    install_norm_fused_forwards(module, adapter)
    if sites:
        install_concat_free_forwards(module, adapter)

    state = load_file(path, device=str(device))
    result = module.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{path} does not match {model}: missing keys {result.missing_keys[:8]}, "
            f"unexpected keys {result.unexpected_keys[:8]}"
        )
    return module
