"""What omni needs to know about one family of diffusers models: :class:`ModelAdapter`.

An adapter is a stateless description (one instance per family, registered in
:mod:`omni_diffusion.adapters`) of

* where the denoiser(s) are on the pipeline (``transformer``; Wan 2.2 also
  ``transformer_2``) and where their repeated blocks are (:class:`BlockList`:
  the ``nn.ModuleList`` attribute, which call argument carries the image stream
  and which the text stream, and the order of the returned tensors);
* which block classes regional ``torch.compile`` compiles;
* how the attention sequence is laid out (:class:`SequenceLayout`: joint
  text+image attention with text first or last, or image self-attention plus
  text cross-attention) and how classifier-free guidance runs (:class:`CFGInfo`):
  what sequence/CFG parallelism builds on;
* which linear layers quantization leaves alone (fnmatch patterns relative to
  the transformer: embedders, final projection, AdaLN modulation layers);
* how omni's attention is installed (diffusers' attention dispatcher by default);
* for TeaCache, the first block's timestep-modulated input and the calibrated
  rescaling polynomial when one is published.

Shared code (accelerate, the caches) asks the adapter; nothing in it tests model
names. A new family is a new module with a registered subclass.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

logger = logging.getLogger("omni_diffusion.adapters")

Undo = Callable[[], None]


@dataclasses.dataclass(frozen=True)
class ActivationFusion:
    """A tanh GELU whose output one linear layer alone reads, in every module of one class.

    W8A8 quantization (``QuantConfig.fuse_activations``) removes the GELU and has
    the quantized linear apply it in its activation-quantization pass
    (:func:`omni_kernels.quant.quantize_activated_per_token`): the GELU's output
    is never written in 16 bits.

    Args:
        owner_class: class name (matched along the MRO) of the modules holding
            both: diffusers' ``FeedForward``, ``FluxSingleTransformerBlock``...
        activation: attribute path, in the owner, of an ``nn.GELU(approximate="tanh")``
            or of diffusers' ``GELU`` module with ``approximate="tanh"`` (its
            ``proj`` stays, its GELU goes).
        consumer: attribute path of the linear layer reading the activation's output.
        concatenated_after: ``None`` when the consumer reads the activation's output
            as it is. Otherwise the attribute path of the linear layer the activation
            reads, for a consumer that reads ``cat([other, activation output], -1)``:
            the activated columns are the consumer's last ``out_features`` of that
            layer (Flux's single blocks: ``proj_out(cat(attn, GELU(proj_mlp(x))))``).
        passthrough: attribute paths of modules between the activation and the
            consumer, each an ``nn.Dropout`` or ``nn.Identity`` (identities at inference).
        concat_free_forward: with ``concatenated_after``, optionally the owner's
            forward (a function of ``(self, *its arguments)``, the same signature as the
            owner class's ``forward``) that hands the consumer its two inputs apart,
            ``consumer.forward_concat(other, activation_input)``, instead of
            materializing their 16-bit ``cat``. Quantization installs it as the instance
            ``forward`` of each owner whose GELU it folded, and removes it on undo.
    """

    owner_class: str
    activation: str
    consumer: str
    concatenated_after: str | None = None
    passthrough: tuple[str, ...] = ()
    concat_free_forward: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class NormFusion:
    """A block class whose LayerNorm + adaLN outputs feed only W8A8 linear layers.

    The block's own forward writes each modulated norm output in 16 bits and every layer
    reading it quantizes it again (under ``torch.compile``, in a kernel Inductor writes). W8A8
    quantization (``QuantConfig.fuse_norms``) installs ``forward`` instead on each block of
    the class that ``unfit`` accepts: it quantizes each modulated norm output once, in omni's
    norm/adaLN-fused kernel (:func:`omni_kernels.quant.quantize_per_token` with
    ``norm="layer"``), and hands the 8-bit tensor to every layer reading it
    (``QuantizedLinear.forward_quantized``).

    Args:
        owner_class: class name (matched along the MRO) of the blocks.
        forward: the block's forward, a function of ``(self, *the class forward's
            arguments)`` computing what the class forward computes; it may fall back to
            the class forward for calls it does not cover (it says which in its docstring).
        unfit: ``unfit(block)`` is why that block cannot take ``forward`` (a layer that is
            not W8A8, a norm that is not a LayerNorm...), or ``None`` when it can.
    """

    owner_class: str
    forward: Callable[..., Any]
    unfit: Callable[[nn.Module], str | None]


#: diffusers' ``FeedForward`` with ``activation_fn="gelu-approximate"``: ``net = [GELU(proj), Dropout, Linear]``
FEED_FORWARD_GELU = ActivationFusion("FeedForward", activation="net.0", consumer="net.2", passthrough=("net.1",))


@dataclasses.dataclass(frozen=True)
class BlockList:
    """One ``nn.ModuleList`` of repeated transformer blocks, run in order.

    Args:
        attr: attribute path on the transformer (``"transformer_blocks"``).
        hidden_arg: name of the block's ``forward`` parameter with the image
            (latent) tokens.
        encoder_arg: name of the parameter with the text tokens, or None.
        outputs: what the block returns, in order: ``("hidden",)`` for a single
            tensor, ``("encoder", "hidden")`` / ``("hidden", "encoder")`` for pairs.
    """

    attr: str
    hidden_arg: str = "hidden_states"
    encoder_arg: str | None = "encoder_hidden_states"
    outputs: tuple[str, ...] = ("encoder", "hidden")

    def __post_init__(self) -> None:
        if "hidden" not in self.outputs or not set(self.outputs) <= {"hidden", "encoder"}:
            raise ValueError(f"BlockList.outputs must name 'hidden' (and 'encoder'): {self.outputs}")

    def module_list(self, transformer: nn.Module) -> nn.ModuleList | None:
        obj: Any = transformer
        for part in self.attr.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj if isinstance(obj, nn.ModuleList) else None

    # --- reading and building a block's arguments and outputs

    def hidden_of(self, output: Any) -> torch.Tensor:
        if isinstance(output, torch.Tensor):
            return output
        return output[self.outputs.index("hidden")]

    def encoder_of(self, output: Any) -> torch.Tensor | None:
        if isinstance(output, torch.Tensor) or "encoder" not in self.outputs:
            return None
        return output[self.outputs.index("encoder")]

    def pack(self, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
        """A block output carrying ``hidden`` (and ``encoder``) in this list's order."""
        if self.outputs == ("hidden",):
            return hidden
        return tuple(hidden if name == "hidden" else encoder for name in self.outputs)


class BlockCall:
    """The arguments of one block call, readable by parameter name."""

    __slots__ = ("args", "kwargs", "_positions")

    def __init__(self, positions: dict[str, int], args: tuple, kwargs: dict) -> None:
        self._positions = positions
        self.args = args
        self.kwargs = kwargs

    def get(self, name: str | None, default: Any = None) -> Any:
        if name is None:
            return default
        if name in self.kwargs:
            return self.kwargs[name]
        index = self._positions.get(name)
        if index is not None and index < len(self.args):
            return self.args[index]
        return default


_POSITIONS: dict[type, dict[str, int]] = {}


def block_call(block: nn.Module, args: tuple, kwargs: dict) -> BlockCall:
    """Wrap a block call's arguments (parameter positions cached per class)."""
    cls = type(block)
    positions = _POSITIONS.get(cls)
    if positions is None:
        positions = {}
        for index, param in enumerate(inspect.signature(cls.forward).parameters.values()):
            if index == 0:
                continue  # self
            if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                positions[param.name] = index - 1
        _POSITIONS[cls] = positions
    return BlockCall(positions, args, kwargs)


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """How text and image tokens meet in attention.

    Args:
        attention: ``"joint"`` (one attention over text and image tokens
            concatenated) or ``"cross"`` (image self-attention, then
            cross-attention to the text).
        text_position: for joint attention, ``"first"`` or ``"last"`` in the
            concatenated sequence; None for cross attention.
        text_mask: whether a text padding mask reaches attention.
        image_dims: the latent token grid (``"HW"`` for images, ``"FHW"`` for video).
    """

    attention: str
    text_position: str | None
    text_mask: bool = False
    image_dims: str = "HW"


@dataclasses.dataclass(frozen=True)
class CFGInfo:
    """How classifier-free guidance runs.

    Args:
        mode: ``"distilled"`` (guidance-distilled: the scale is an embedding,
            one transformer call per step), ``"batched"`` (conditional and
            unconditional in one call, concatenated along the batch) or
            ``"separate"`` (one call each, in diffusers' ``cache_context("cond")``
            / ``("uncond")``).
        guidance_embedded: the guidance scale enters the transformer as an embedding.
        true_cfg_argument: the pipeline argument that adds separate-call true
            CFG to a distilled model (``"true_cfg_scale"``), if any.
        scale_argument: for ``"separate"`` mode, the pipeline argument whose
            value above 1 turns the unconditional call on (default:
            ``true_cfg_argument``); CFG parallelism reads it before the call.
        negative_arguments: for ``"separate"`` mode, pipeline arguments of
            which one must be given for the unconditional call to run (empty:
            the scale alone decides).
    """

    mode: str
    guidance_embedded: bool = False
    true_cfg_argument: str | None = None
    scale_argument: str | None = None
    negative_arguments: tuple[str, ...] = ()

    @property
    def guidance_scale_argument(self) -> str | None:
        return self.scale_argument or self.true_cfg_argument


@dataclasses.dataclass(frozen=True)
class SequenceParallelPlan:
    """Where sequence parallelism (:mod:`omni_diffusion.parallel`) splits a family's tokens.

    The image (latent) tokens are split along the sequence across the
    ``ulysses * ring`` ranks from the first block's input to the last block's
    output; text tokens stay replicated on every rank (they are few, and the
    text stream's per-token layers then need no communication).

    Text padding masks: when the adapter's ``layout.text_mask`` is set, joint
    attention may receive a boolean key-padding mask over its local tokens
    (``[B, 1, 1, T + n]`` or ``[B, T + n]``, layout order, True = attend) whose
    image part is all True by the model's construction (image tokens are never
    padding): sequence parallelism applies its text part to the replicated
    text keys and attends every image key. Without ``text_mask`` a mask is refused.

    Args:
        joint_attention: fnmatch patterns (relative to the transformer) of the
            attention modules over text + image tokens (``layout`` says where
            the text is).
        image_attention: patterns of attention modules over the image tokens
            alone (self-attention). Attention modules matching neither
            (cross-attention to the text) run locally, unchanged.
        rotary_arg: the block argument holding rotary tables (a tensor or a
            tuple of tensors), or None; a tuple of names when block classes of
            one model name it differently (the first name a block has is used).
        rotary_seq_dim: the sequence dimension of those tables.
        rotary_covers_text: the tables span text and image tokens (in the
            layout's order), not the image tokens alone.
        rotary_text_entries: positions, in a tuple of rotary tables, of tables
            over the text tokens alone (separate text frequencies): passed
            whole, as the text is replicated.
        mask_arg: the block argument holding a key-padding mask over the whole
            joint sequence (text and image in the layout's order), cut to this
            rank's tokens per block like the rotary tables; None when the
            attention builds its mask from the local tokens itself.
        mask_seq_dim: the sequence dimension of that mask.
        image_token_args: block arguments with one entry per image token along
            dimension 1 (``[B, S_image, ...]``), cut to this rank's tokens like
            the hidden states.
        leading_image_count_args: block arguments counting image tokens at the
            start of the image sequence (an int; blocks treat those tokens
            apart): replaced by how many of them this rank's shard holds, which
            are then at the start of the shard.
    """

    joint_attention: tuple[str, ...] = ()
    image_attention: tuple[str, ...] = ()
    rotary_arg: str | tuple[str, ...] | None = None
    rotary_seq_dim: int = 0
    rotary_covers_text: bool = False
    rotary_text_entries: tuple[int, ...] = ()
    mask_arg: str | None = None
    mask_seq_dim: int = -1
    image_token_args: tuple[str, ...] = ()
    leading_image_count_args: tuple[str, ...] = ()

    @property
    def rotary_args(self) -> tuple[str, ...]:
        """``rotary_arg`` as a tuple of names (empty when there are no rotary tables)."""
        if self.rotary_arg is None:
            return ()
        return (self.rotary_arg,) if isinstance(self.rotary_arg, str) else tuple(self.rotary_arg)


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """How tensor parallelism shards a family's blocks (fnmatch patterns relative
    to the transformer, matched against ``nn.Linear`` / quantized-linear names).

    Args:
        colwise: output features split across ranks (Q/K/V projections, the
            first MLP layer); the modules owning a split ``to_q`` get their
            ``heads`` divided, and their ``inner_dim``-style widths with them.
        rowwise: input features split; partial outputs are summed by one
            all-reduce and the bias is added once.
        packed_rowwise: rowwise layers whose input is a concatenation of
            separately column-split parts (Flux's single-block ``proj_out``
            over ``[attention, mlp]``); the adapter's
            :meth:`ModelAdapter.tp_packed_sizes` gives the parts.
        sharded_norms: RMSNorms over all heads at once (Wan's ``norm_q``) whose
            input is column-split: they become norms that all-reduce the sum
            of squares.
    """

    colwise: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()
    packed_rowwise: tuple[str, ...] = ()
    sharded_norms: tuple[str, ...] = ()

    def extended(self, *, colwise: tuple[str, ...] = (), rowwise: tuple[str, ...] = (),
                 packed_rowwise: tuple[str, ...] = ()) -> TensorParallelPlan:
        """This plan with more patterns of each kind."""
        return dataclasses.replace(self, colwise=self.colwise + colwise, rowwise=self.rowwise + rowwise,
                                   packed_rowwise=self.packed_rowwise + packed_rowwise)


def joint_attention_tp(blocks: str, mlps: tuple[str, str]) -> TensorParallelPlan:
    """Tensor-parallel plan of dual-stream joint-attention blocks ``<blocks>.*``: diffusers'
    ``Attention`` with ``add_[qkv]_proj`` for the text stream, and one diffusers ``FeedForward``
    per stream (``mlps``: image, text). Q/K/V of both streams and each MLP's first layer
    column-split; both output projections and each MLP's second layer row-split."""
    return TensorParallelPlan(
        colwise=(f"{blocks}.*.attn.to_[qkv]", f"{blocks}.*.attn.add_[qkv]_proj",
                 *(f"{blocks}.*.{mlp}.net.0.proj" for mlp in mlps)),
        rowwise=(f"{blocks}.*.attn.to_out.0", f"{blocks}.*.attn.to_add_out",
                 *(f"{blocks}.*.{mlp}.net.2" for mlp in mlps)),
    )


#: Tensor-parallel plan of diffusers' Flux-style blocks, by their module names: dual-stream
#: ``transformer_blocks`` (image and text streams, joint attention) then single-stream
#: ``single_transformer_blocks`` (q/k/v and the MLP in parallel, one ``proj_out`` over
#: ``cat([attention, mlp])``). FluxTransformer2DModel and HunyuanVideoTransformer3DModel both use
#: this layout (with :func:`single_stream_packed_sizes`); an adapter extends it with its own
#: extra modules.
DUAL_SINGLE_STREAM_TP = joint_attention_tp("transformer_blocks", ("ff", "ff_context")).extended(
    colwise=("single_transformer_blocks.*.attn.to_[qkv]", "single_transformer_blocks.*.proj_mlp"),
    # its input is cat([attention output, mlp hidden]), each column-split
    packed_rowwise=("single_transformer_blocks.*.proj_out",),
)


def single_stream_packed_sizes(transformer: nn.Module, linear: nn.Module) -> list[int]:
    """The parts of a single-stream block's ``proj_out`` input (:data:`DUAL_SINGLE_STREAM_TP`):
    the attention output (heads x head size), then the MLP hidden."""
    attention_width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    return [attention_width, linear.in_features - attention_width]


class ModelAdapter:
    """Base class of the per-family adapters; see the module docstring."""

    #: short family name ("flux")
    name: ClassVar[str] = ""
    #: diffusers pipeline class names this adapter serves (matched along the MRO)
    pipeline_classes: ClassVar[tuple[str, ...]] = ()
    #: diffusers transformer class names (for pipelines not listed, and transformer-only use)
    transformer_classes: ClassVar[tuple[str, ...]] = ()
    #: pipeline attributes holding denoisers, in order; missing/None ones are skipped
    transformer_attrs: ClassVar[tuple[str, ...]] = ("transformer",)
    block_lists: ClassVar[tuple[BlockList, ...]] = ()
    layout: ClassVar[SequenceLayout] = SequenceLayout("joint", "first")
    cfg: ClassVar[CFGInfo] = CFGInfo("separate")
    #: fnmatch patterns (relative to the transformer) quantization leaves alone
    quant_skip: ClassVar[tuple[str, ...]] = ()
    #: fnmatch patterns of linear layers that read one row per sample (adaLN modulation): bound by
    #: reading their weight, they gain from 8-bit weights but not from 8-bit activations, so under
    #: a W8A8 method accelerate() gives them INT8 weight-only (QuantConfig.layer_methods); under a
    #: weight-only method they take that method
    quant_weight_only: ClassVar[tuple[str, ...]] = ()
    #: regional compile with fullgraph=True works for these blocks
    compile_fullgraph: ClassVar[bool] = True
    #: transformer forward arguments that, when not None, make a step uncacheable
    #: (ControlNet residuals are added between blocks, which caching would drop)
    cache_disabling_kwargs: ClassVar[tuple[str, ...]] = ()
    #: TeaCache warm-up steps the calibration assumed
    teacache_warmup_steps: ClassVar[int] = 1
    #: sequence parallelism (None: the family does not support it)
    sequence_parallel: ClassVar[SequenceParallelPlan | None] = None
    #: tensor parallelism (None: the family does not support it)
    tensor_parallel: ClassVar[TensorParallelPlan | None] = None
    #: attention modules (fnmatch patterns relative to the transformer) whose to_q/to_k/to_v
    #: read one input (and add_q/k/v_proj another): quantization may fuse each triple into one
    #: linear with the module's own diffusers ``fuse_projections()`` (``to_qkv``,
    #: ``to_added_qkv``), so one activation quantization and one GEMM serve all three
    #: (``QuantConfig.fuse_projections``); see :meth:`fused_attention_processor`
    fusable_attention: ClassVar[tuple[str, ...]] = ()
    #: GELUs that W8A8 quantization folds into the linear layer reading their output
    #: (:class:`ActivationFusion`; ``QuantConfig.fuse_activations``)
    activation_fusions: ClassVar[tuple[ActivationFusion, ...]] = ()
    #: blocks whose LayerNorm + adaLN outputs W8A8 quantization quantizes in omni's fused
    #: kernel, once for all layers reading them (:class:`NormFusion`; ``QuantConfig.fuse_norms``)
    norm_fusions: ClassVar[tuple[NormFusion, ...]] = ()

    # ------------------------------------------------------------------ structure

    def transformers(self, pipe: Any) -> dict[str, nn.Module]:
        """``{attribute: denoiser}`` of ``pipe`` (``transformer``, ``transformer_2``...)."""
        found = {}
        for attr in self.transformer_attrs:
            module = getattr(pipe, attr, None)
            if isinstance(module, nn.Module):
                found[attr] = module
        if not found:
            raise ValueError(
                f"{type(pipe).__name__} has no denoiser at {', '.join(self.transformer_attrs)}"
            )
        return found

    def blocks(self, transformer: nn.Module) -> list[tuple[BlockList, nn.ModuleList]]:
        """The block lists present on ``transformer`` (empty lists left out)."""
        lists = []
        for spec in self.block_lists:
            module_list = spec.module_list(transformer)
            if module_list is not None and len(module_list) > 0:
                lists.append((spec, module_list))
        if not lists:
            raise ValueError(
                f"{type(transformer).__name__} has none of the block lists the {self.name} adapter "
                f"expects ({', '.join(s.attr for s in self.block_lists)})"
            )
        return lists

    def repeated_block_classes(self, transformer: nn.Module) -> tuple[str, ...]:
        """Class names regional compile compiles: the model's ``_repeated_blocks``
        (diffusers' declaration), else the classes in :attr:`block_lists`."""
        declared = tuple(getattr(transformer, "_repeated_blocks", None) or ())
        if declared:
            return declared
        names: list[str] = []
        for _, module_list in self.blocks(transformer):
            for block in module_list:
                if type(block).__name__ not in names:
                    names.append(type(block).__name__)
        return tuple(names)

    # ------------------------------------------------------------------ attention

    def apply_attention(self, transformer: nn.Module, omni_backend: str | None) -> Undo:
        """Route the transformer's attention to omni; returns the undo.

        Default: every attention processor that goes through diffusers'
        dispatcher (it has ``_attention_backend``) is pointed at omni's
        diffusers backend (``"omni"``, or ``"omni:<backend>"`` pinned to one
        omni backend). Unlike ``ModelMixin.set_attention_backend`` this does not
        change diffusers' process-wide active backend, so other models are not
        affected. ``omni_backend=None`` picks per call (``"auto"``).
        """
        from omni_diffusion.attention.diffusers_backend import OMNI_BACKEND_NAME, register_omni_attention_backend

        name = OMNI_BACKEND_NAME if omni_backend is None else f"{OMNI_BACKEND_NAME}:{omni_backend}"
        member = register_omni_attention_backend(name, omni_backend=omni_backend)
        saved: list[tuple[Any, bool, Any]] = []  # (processor, had its own value, value)
        for module in transformer.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_attention_backend"):
                if all(processor is not p for p, _, _ in saved):
                    own = "_attention_backend" in getattr(processor, "__dict__", {})
                    saved.append((processor, own, processor._attention_backend))
        if not saved:
            raise ValueError(
                f"{type(transformer).__name__}: no attention processor goes through diffusers' "
                f"attention dispatcher, and the {self.name} adapter has no other route"
            )
        for processor, _, _ in saved:
            processor._attention_backend = member

        def undo() -> None:
            for processor, own, previous in saved:
                if own:
                    processor._attention_backend = previous
                else:  # the class attribute shows through again, as before
                    processor.__dict__.pop("_attention_backend", None)

        return undo

    def fused_norm_rope_processor(self, module: nn.Module) -> Any:
        """A processor for attention module ``module`` that runs its QK norm and rotary
        embedding as one omni kernel (:func:`omni_kernels.qk_norm_rope.qk_rmsnorm_rope`),
        taking over ``_attention_backend`` and ``_parallel_config`` from the current one; or
        None to leave ``module`` as it is (the default: the family has no such processor)."""
        return None

    @property
    def has_fused_norm_rope(self) -> bool:
        """Whether the family overrides :meth:`fused_norm_rope_processor`."""
        return type(self).fused_norm_rope_processor is not ModelAdapter.fused_norm_rope_processor

    def apply_fused_norm_rope(self, transformer: nn.Module) -> Undo:
        """Give every attention module of ``transformer`` that :meth:`fused_norm_rope_processor`
        covers that processor; returns the undo (the previous processors back).

        Raises:
            ValueError: the family has no such processor, or no module of ``transformer`` took it.
        """
        if not self.has_fused_norm_rope:
            raise ValueError(
                f"fused_norm_rope: the {self.name} adapter has no fused QK-norm + RoPE attention processor "
                f"(families with one: see omni_diffusion.adapters, e.g. flux)"
            )
        replaced: list[tuple[nn.Module, Any]] = []
        for module in transformer.modules():
            processor = self.fused_norm_rope_processor(module) if hasattr(module, "processor") else None
            if processor is not None:
                replaced.append((module, module.processor))
                module.set_processor(processor)
        if not replaced:
            raise ValueError(
                f"fused_norm_rope: no attention module of {type(transformer).__name__} has a processor the "
                f"{self.name} adapter can replace"
            )

        def undo() -> None:
            for module, previous in reversed(replaced):
                module.set_processor(previous)

        return undo

    def apply_parallel_attention(self, module: nn.Module, parallel: Any) -> Undo:
        """Make attention module ``module`` run its attention through ``parallel``
        (a :class:`omni_diffusion.parallel.sequence_attention.SequenceParallelAttention`).

        Default: its processor goes through diffusers' dispatcher; it is pointed
        at omni's sequence-parallel diffusers backend with ``parallel`` as its
        ``_parallel_config`` (which the dispatcher hands to the backend).
        """
        # imported here: the parallel package imports the adapters when it loads
        from omni_diffusion.parallel.sequence_attention import route_dispatcher_processor

        return route_dispatcher_processor(module, parallel)

    def tp_packed_sizes(self, transformer: nn.Module, name: str, linear: nn.Module) -> list[int]:
        """The parts of a ``packed_rowwise`` layer's input features, in order."""
        raise ValueError(f"the {self.name} adapter declares no packed input sizes for {name}")

    def fused_attention_processor(self, module: nn.Module) -> Any:
        """The processor that runs attention module ``module`` (one of
        :attr:`fusable_attention`) once its projections are fused: its current
        processor when that reads ``module.fused_projections``, a replacement, or
        None to leave ``module`` unfused (the default)."""
        return None

    # ------------------------------------------------------------------ caching

    def teacache_input(self, block: nn.Module, call: BlockCall) -> torch.Tensor | None:
        """The first block's timestep-modulated input TeaCache compares across
        steps, or None when the adapter has none (TeaCache then refuses)."""
        return None

    def teacache_coefficients(self, transformer: nn.Module, pipe: Any = None) -> tuple[float, ...] | None:
        """TeaCache's calibrated rescaling polynomial (highest power first) for
        this model, or None (the raw relative L1 distance is accumulated)."""
        return None

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (for logs, omni-serve's model info)."""
        return dict(
            name=self.name,
            pipelines=list(self.pipeline_classes),
            transformers=list(self.transformer_classes),
            transformer_attrs=list(self.transformer_attrs),
            block_lists=[dataclasses.asdict(b) for b in self.block_lists],
            layout=dataclasses.asdict(self.layout),
            cfg=dataclasses.asdict(self.cfg),
            quant_skip=list(self.quant_skip),
            quant_weight_only=list(self.quant_weight_only),
        )


def replacement_processor(module: nn.Module, class_name: str, build: Callable[[], Any]) -> Any:
    """``build()``, a processor to replace ``module``'s when that is exactly a ``class_name``
    (subclasses such as IP-adapter processors keep theirs), carrying over the instance's
    ``_attention_backend`` and ``_parallel_config`` (diffusers' dispatcher settings); else None."""
    processor = getattr(module, "processor", None)
    if type(processor).__name__ != class_name:
        return None
    new = build()
    for attr in ("_attention_backend", "_parallel_config"):
        if attr in getattr(processor, "__dict__", {}):
            setattr(new, attr, getattr(processor, attr))
    return new


def rms_norm_params(norm: nn.Module | None) -> tuple[torch.Tensor | None, float] | None:
    """``(weight or None, eps)`` of a bias-free RMSNorm (diffusers' or ``torch.nn.RMSNorm``
    with an explicit ``eps``), for a fused kernel to apply; None for any other module,
    including tensor parallelism's ``ShardedRMSNorm`` (its mean square spans ranks)."""
    if (type(norm).__name__ != "RMSNorm" or getattr(norm, "eps", None) is None
            or getattr(norm, "bias", None) is not None):
        return None
    return getattr(norm, "weight", None), float(norm.eps)


def rms_norm_pair(norm_q: nn.Module | None, norm_k: nn.Module | None) -> tuple[Any, Any, float] | None:
    """``(q weight, k weight, eps)`` when both are :func:`rms_norm_params` norms with one eps
    (the fused QK kernel takes one eps a call), else None."""
    q, k = rms_norm_params(norm_q), rms_norm_params(norm_k)
    if q is None or k is None or q[1] != k[1]:
        return None
    return q[0], k[0], q[1]


def modulated_norm_input(norm: nn.Module, call: BlockCall, hidden_arg: str = "hidden_states",
                         temb_arg: str = "temb") -> torch.Tensor:
    """``norm(hidden, emb=temb)[0]``: an AdaLayerNormZero-style block input norm."""
    out = norm(call.get(hidden_arg), emb=call.get(temb_arg))
    return out[0] if isinstance(out, tuple) else out


__all__ = [
    "BlockCall",
    "BlockList",
    "CFGInfo",
    "ModelAdapter",
    "SequenceLayout",
    "SequenceParallelPlan",
    "TensorParallelPlan",
    "block_call",
    "joint_attention_tp",
    "modulated_norm_input",
    "replacement_processor",
    "rms_norm_pair",
    "rms_norm_params",
    "single_stream_packed_sizes",
]
