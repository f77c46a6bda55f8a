"""QuantConfig: how :func:`~omni_diffusion.quantization.quantize` quantizes a model, and the
fnmatch matching of its layer-name patterns."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass, field

from omni_kernels.quant import LINEAR_BACKENDS, QUANT_METHODS
from omni_kernels.quant.linear import ACTIVATION_BACKENDS, check_split_k

# No model-specific defaults here: callers (the runtime's model adapters) pass the measured
# skip list of their model family.
DEFAULT_SKIP: tuple[str, ...] = ()


# The fusion switches, and why the ones that act on activation quantization need a W8A8 method.
_FUSION_FLAGS = (
    ("fuse_projections", None),
    ("fuse_activations", "it folds a GELU into the activation quantization"),
    ("fuse_norms", "it quantizes the norm output for W8A8 layers"),
)


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
            quantizing, where the model's adapter declares them
            (:mod:`.projections`): one activation quantization and one GEMM instead of
            three, the same numbers. ``None`` (default): on for the W8A8
            methods, off for weight-only ones (no activation quantization to
            save).
        fuse_activations: fold the GELUs the model's adapter declares
            (:mod:`.activations`) into the W8A8 layer reading their output. ``None``
            (default): on for W8A8 methods; ``True`` with a weight-only method is
            an error.
        fuse_norms: give the blocks the model's adapter declares (:mod:`.norm_fusion`) a
            forward that quantizes each LayerNorm + adaLN output once, in omni's fused
            kernel, for all the W8A8 layers reading it. ``None`` (default): on for W8A8
            methods; ``True`` with a weight-only method is an error.

    ``activation_backend="auto"`` runs omni's CUDA/Triton kernel in eager mode
    and, under ``torch.compile``, the reference's plain torch ops, which Inductor
    fuses into the kernel producing the layer's input (the LayerNorm + adaLN
    modulation, the GELU) instead of writing that input in 16 bits and reading it
    back; ``"torch"`` asks for the torch ops in eager mode too (slow there: the
    float32 reference), ``"cuda"``/``"triton"`` for the kernel under compile too.
    ``"split"`` (opt-in) is ``"auto"`` in eager mode and picks per layer under compile:
    the fused torch ops for ``in_features <= split_k``, the kernel op (which reads the
    materialized 16-bit input once) above, for wide inputs that Inductor fuses poorly
    (Flux's single blocks' ``proj_out``, K = 15360).
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
        for name, needs_w8a8 in _FUSION_FLAGS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(
                    f"QuantConfig.{name} must be True, False or None (on for W8A8 methods); got {value!r}"
                )
            if value and needs_w8a8 and self.weight_only:
                raise ValueError(f"QuantConfig.{name}=True needs a W8A8 method ({needs_w8a8}); got method {self.method!r}")

    @property
    def weight_only(self) -> bool:
        """Whether ``method`` (the default method) is weight-only."""
        return self.method.endswith("_weight_only")

    def method_for(self, name: str) -> str:
        """The method of linear layer ``name``: the first matching ``layer_methods`` pattern's, else ``method``."""
        return next((m for pattern, m in self.layer_methods if name_matches(name, pattern)), self.method)

    @property
    def fuses_activations(self) -> bool:
        """``fuse_activations`` with ``None`` resolved (on for W8A8 methods)."""
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


def name_matches(name: str, pattern: str) -> bool:
    """True when ``pattern`` matches ``name`` or one of its parents (``a.b`` for ``a.b.c``)."""
    parts = name.split(".") if name else [""]
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))
