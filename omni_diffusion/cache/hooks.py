"""First-Block-Cache and TeaCache as hooks on a diffusers transformer.

How the hooks sit (:class:`CacheController`, one per denoiser):

* Each block ``nn.ModuleList`` the adapter names gets its class swapped for
  :class:`_CachedBlockList`, whose ``__iter__`` yields, while a generation runs, proxies
  that decide per call whether to run the real block or pass its inputs through. The
  transformer's own ``forward`` runs unchanged, the blocks (names, identity) are untouched,
  so the decision stays outside regionally compiled blocks, and undo swaps the class back.
* A forward pre-hook on the transformer opens the pass (generation and branch, see
  :mod:`omni_diffusion.cache.state`); a forward hook closes it (stores the residual, counts
  hits). The wrapped ``cache_context`` tells the hooks the branch ("cond"/"uncond") and step.

First-Block-Cache: the first block always runs; when the relative L1 change of its output
residual ``out0 - in0`` since the last fully computed step is below ``threshold``, the other
blocks are skipped and the output is ``out0 + cached(last - out0)``.

TeaCache: the relative L1 change of the adapter's timestep-modulated input, rescaled by the
calibrated polynomial, is accumulated; while the sum stays below ``threshold`` the whole stack
is skipped (``output = input + cached(last - input)``), else it runs and the sum restarts.

Both: the first ``warmup_steps`` and last ``final_steps`` always run, at most
``max_consecutive_hits`` in a row are skipped, ``threshold = 0`` never skips, and ControlNet
residuals (the adapter's ``cache_disabling_kwargs``) turn caching off for that call.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

import torch
from torch import nn

from omni_diffusion.adapters.base import BlockList, ModelAdapter, block_call
from omni_diffusion.cache.state import BRANCH, PassState, current_generation
from omni_diffusion.config import CacheConfig

logger = logging.getLogger("omni_diffusion.cache")


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """``mean|current - previous| / mean|previous|`` as a float (one host sync)."""
    num = (current - previous).abs().mean(dtype=torch.float32)
    den = previous.abs().mean(dtype=torch.float32)
    return float((num / den.clamp_min(1e-12)).item())


def _poly(coefficients: tuple[float, ...], x: float) -> float:
    value = 0.0
    for c in coefficients:
        value = value * x + c
    return value


class _BlockProxy:
    """Stands in for one block while a generation runs (see the module docstring)."""

    __slots__ = ("_ctl", "_spec", "_block")

    def __init__(self, ctl: CacheController, spec: BlockList, block: nn.Module) -> None:
        self._ctl = ctl
        self._spec = spec
        self._block = block

    def __call__(self, *args, **kwargs):
        return self._ctl.run_block(self._spec, self._block, args, kwargs)

    def __getattr__(self, name: str) -> Any:  # e.g. SD3 reads block.context_pre_only
        return getattr(self._block, name)


class _CachedBlockList(nn.ModuleList):
    """A ModuleList that yields cache proxies while its controller has an open pass."""

    def __iter__(self):
        ctl = self.__dict__.get("_omni_cache_ctl")
        if ctl is not None and ctl.active_pass() is not None:
            spec = self.__dict__["_omni_cache_spec"]
            return iter([_BlockProxy(ctl, spec, block) for block in super().__iter__()])
        return super().__iter__()


class CacheController:
    """First-Block-Cache / TeaCache on one denoiser of a pipeline."""

    def __init__(
        self,
        denoiser: str,
        transformer: nn.Module,
        adapter: ModelAdapter,
        config: CacheConfig,
        pipe: Any = None,
        clone_kept_outputs: bool = False,
    ) -> None:
        if config.kind not in ("first_block", "teacache"):
            raise ValueError(f"CacheController runs first_block and teacache, not {config.kind!r}")
        self.denoiser = denoiser
        self.transformer = transformer
        self.adapter = adapter
        self.kind = config.kind
        self.threshold = float(config.threshold)
        self.final_steps = int(config.final_steps)
        self.max_consecutive_hits = config.max_consecutive_hits
        self.clone_kept_outputs = clone_kept_outputs
        self.lists = adapter.blocks(transformer)
        self.num_blocks = sum(len(module_list) for _, module_list in self.lists)
        if self.kind == "teacache":
            if type(adapter).teacache_input is ModelAdapter.teacache_input:
                raise ValueError(
                    f"TeaCache needs the model's timestep-modulated input, which the {adapter.name} "
                    "adapter does not define; use cache='first_block'"
                )
            self.warmup_steps = (
                adapter.teacache_warmup_steps if config.warmup_steps is None else config.warmup_steps
            )
            self.coefficients = config.coefficients or adapter.teacache_coefficients(transformer, pipe)
            if self.coefficients is None:
                logger.info(
                    "TeaCache on %s (%s): no calibrated polynomial; accumulating the raw relative "
                    "L1 distance (pass CacheConfig(coefficients=...) to rescale)",
                    type(transformer).__name__, adapter.name,
                )
        else:
            self.warmup_steps = 1 if config.warmup_steps is None else config.warmup_steps
            self.coefficients = None
        self._timestep_index = self._find_param(type(transformer).forward, "timestep")
        self._installed: list[tuple[nn.ModuleList, type]] = []
        self._handles: list[Any] = []
        self._wrapped_cache_context = False
        self._warned_no_skip = False

    @staticmethod
    def _find_param(fn, name: str) -> int | None:
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return None
        return params.index(name) - 1 if name in params else None

    # ------------------------------------------------------------------ install

    def install(self) -> None:
        for spec, module_list in self.lists:
            if "_omni_cache_ctl" in module_list.__dict__:
                raise ValueError(
                    f"{type(self.transformer).__name__}.{spec.attr} already has omni's cache hooks "
                    "(is this transformer shared with another accelerated pipeline? undo that first)"
                )
        for spec, module_list in self.lists:
            original_cls = type(module_list)
            module_list.__class__ = _cached_list_class(original_cls)
            module_list.__dict__["_omni_cache_ctl"] = self
            module_list.__dict__["_omni_cache_spec"] = spec
            self._installed.append((module_list, original_cls))
        self._handles.append(
            self.transformer.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        )
        self._handles.append(
            self.transformer.register_forward_hook(self._post_forward, with_kwargs=True)
        )
        original = getattr(self.transformer, "cache_context", None)
        if callable(original) and "cache_context" not in self.transformer.__dict__:
            self.transformer.__dict__["cache_context"] = self._make_cache_context(original)
            self._wrapped_cache_context = True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module_list, original_cls in self._installed:
            module_list.__dict__.pop("_omni_cache_ctl", None)
            module_list.__dict__.pop("_omni_cache_spec", None)
            module_list.__class__ = original_cls
        self._installed.clear()
        if self._wrapped_cache_context:
            self.transformer.__dict__.pop("cache_context", None)
            self._wrapped_cache_context = False

    def _make_cache_context(self, original):
        key = id(self.transformer)

        @contextlib.contextmanager
        def cache_context(name: str, **kwargs):
            token = BRANCH.set((key, name, kwargs))
            try:
                with original(name, **kwargs):
                    yield
            finally:
                BRANCH.reset(token)

        cache_context.__doc__ = original.__doc__
        cache_context._omni_wrapped = original
        return cache_context

    # ------------------------------------------------------------------ passes

    def active_pass(self) -> PassState | None:
        gen = current_generation()
        return None if gen is None else gen.passes.get(id(self))

    def _timestep_value(self, args: tuple, kwargs: dict) -> float | None:
        t = kwargs.get("timestep")
        if t is None and self._timestep_index is not None and self._timestep_index < len(args):
            t = args[self._timestep_index]
        if t is None:
            return None
        if isinstance(t, torch.Tensor):
            return float(t.reshape(-1)[0].item()) if t.numel() else None
        return float(t)

    def _pre_forward(self, module, args, kwargs):
        gen = current_generation()
        if gen is None:
            return None
        context = BRANCH.get()
        info: dict = {}
        if context is not None and context[0] in (None, id(self.transformer)):
            name, info = context[1], context[2]
        else:
            t = self._timestep_value(args, kwargs)
            seen_key = (id(self), t)
            count = gen.seen_timesteps.get(seen_key, 0)
            gen.seen_timesteps[seen_key] = count + 1
            name = f"call{count}"
        branch = gen.branch(self.denoiser, name)
        step = info.get("step_index")
        if step is None:
            step = branch.passes
        total = info.get("num_inference_steps")
        if total is None and gen.pipe is not None:
            total = getattr(gen.pipe, "_num_timesteps", None)
        if total is not None and not self._warned_no_skip and total <= self.warmup_steps + self.final_steps:
            self._warned_no_skip = True  # once per install: a server would repeat it every request
            logger.warning(
                "%s cache on %s: %d steps are within its %d warm-up + %d final steps, which always "
                "compute, so no step can be skipped; use more steps or fewer warm-up/final steps",
                self.kind, self.denoiser, total, self.warmup_steps, self.final_steps)
        state = PassState(branch=branch, step=int(step), total=total)
        state.disabled = any(kwargs.get(k) is not None for k in self.adapter.cache_disabling_kwargs)
        gen.passes[id(self)] = state
        return None

    def _post_forward(self, module, args, kwargs, output):
        gen = current_generation()
        if gen is None:
            return None
        state = gen.passes.pop(id(self), None)
        if state is None:
            return None
        branch = state.branch
        branch.passes += 1
        branch.blocks_run += state.blocks_run
        branch.blocks_skipped += state.blocks_skipped
        if state.disabled:
            return None
        if state.skipping:
            branch.hits += 1
            branch.consecutive_hits += 1
            return None
        branch.consecutive_hits = 0
        if state.last_hidden is not None and state.ref_hidden is not None:
            branch.residual_hidden = state.last_hidden - state.ref_hidden
            if (
                state.last_encoder is not None
                and state.ref_encoder is not None
                and state.last_encoder.shape == state.ref_encoder.shape
            ):
                branch.residual_encoder = state.last_encoder - state.ref_encoder
            else:
                branch.residual_encoder = None
        return None

    def _may_skip(self, state: PassState) -> bool:
        if self.threshold <= 0 or state.step < self.warmup_steps:
            return False
        if state.total is not None and state.step >= state.total - self.final_steps:
            return False
        if self.max_consecutive_hits is not None and (
            state.branch.consecutive_hits >= self.max_consecutive_hits
        ):
            return False
        return state.branch.residual_hidden is not None

    def _keep(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is not None and self.clone_kept_outputs:
            return tensor.clone()
        return tensor

    # ------------------------------------------------------------------ blocks

    def run_block(self, spec: BlockList, block: nn.Module, args: tuple, kwargs: dict):
        state = self.active_pass()
        if state is None or state.disabled:
            if state is not None:
                state.blocks_run += 1
            return block(*args, **kwargs)
        if not state.started:
            state.started = True
            if self.kind == "first_block":
                return self._first_block_fbc(state, spec, block, args, kwargs)
            return self._first_block_teacache(state, spec, block, args, kwargs)
        if state.skipping:  # counted as skipped when the first block decided
            call = block_call(block, args, kwargs)
            return spec.pack(call.get(spec.hidden_arg), call.get(spec.encoder_arg))
        out = block(*args, **kwargs)
        state.blocks_run += 1
        state.last_hidden = spec.hidden_of(out)
        state.last_encoder = spec.encoder_of(out)
        return out

    @staticmethod
    def _same_shape(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        return a is not None and b is not None and a.shape == b.shape

    def _cached_output(self, state: PassState, spec: BlockList, hidden, encoder):
        branch = state.branch
        hidden = hidden + branch.residual_hidden
        if branch.residual_encoder is not None and self._same_shape(encoder, branch.residual_encoder):
            encoder = encoder + branch.residual_encoder
        return spec.pack(hidden, encoder)

    def _first_block_fbc(self, state: PassState, spec: BlockList, block, args, kwargs):
        call = block_call(block, args, kwargs)
        hidden_in = call.get(spec.hidden_arg)
        out = block(*args, **kwargs)
        state.blocks_run += 1
        hidden0 = spec.hidden_of(out)
        encoder0 = spec.encoder_of(out)
        residual = hidden0 - hidden_in
        branch = state.branch
        hit = False
        if branch.reference is not None and self._same_shape(residual, branch.reference):
            distance = relative_l1(residual, branch.reference)
            branch.distances.append(distance)
            hit = (
                self._may_skip(state)
                and self._same_shape(hidden0, branch.residual_hidden)
                and distance < self.threshold
            )
        if hit:
            state.skipping = True
            state.blocks_skipped += self.num_blocks - 1
            return self._cached_output(state, spec, hidden0, encoder0)
        branch.reference = residual
        state.ref_hidden = self._keep(hidden0)
        state.ref_encoder = self._keep(encoder0)
        state.last_hidden, state.last_encoder = state.ref_hidden, state.ref_encoder
        return out

    def _first_block_teacache(self, state: PassState, spec: BlockList, block, args, kwargs):
        call = block_call(block, args, kwargs)
        hidden_in = call.get(spec.hidden_arg)
        encoder_in = call.get(spec.encoder_arg)
        modulated = self.adapter.teacache_input(block, call)
        branch = state.branch
        hit = False
        if (
            branch.reference is not None
            and self._same_shape(modulated, branch.reference)
            and self._may_skip(state)
            and self._same_shape(hidden_in, branch.residual_hidden)
        ):
            x = relative_l1(modulated, branch.reference)
            distance = _poly(self.coefficients, x) if self.coefficients else x
            branch.distances.append(distance)
            branch.accumulated += distance
            hit = branch.accumulated < self.threshold
        branch.reference = modulated.detach()
        if hit:
            state.skipping = True
            state.blocks_skipped += self.num_blocks
            return self._cached_output(state, spec, hidden_in, encoder_in)
        branch.accumulated = 0.0
        out = block(*args, **kwargs)
        state.blocks_run += 1
        state.ref_hidden, state.ref_encoder = hidden_in, encoder_in
        state.last_hidden = spec.hidden_of(out)
        state.last_encoder = spec.encoder_of(out)
        return out


_LIST_CLASSES: dict[type, type] = {}


def _cached_list_class(original: type) -> type:
    """A subclass of ``original`` (a ModuleList class) with the caching ``__iter__``."""
    if issubclass(original, _CachedBlockList):
        return original
    cls = _LIST_CLASSES.get(original)
    if cls is None:
        if original is nn.ModuleList:
            cls = _CachedBlockList
        else:
            cls = type(original.__name__, (_CachedBlockList, original), {})
        _LIST_CLASSES[original] = cls
    return cls


__all__ = ["CacheController", "relative_l1"]
