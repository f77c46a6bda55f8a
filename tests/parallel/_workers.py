"""What each rank of a :class:`_pool.DistPool` runs: ``fn(rank, world, *args)``.

Every rank builds the same seeded inputs, computes the single-process reference
itself, then the parallel result, and returns the max abs difference (fp32).
"""

from __future__ import annotations

import torch

from omni_diffusion.parallel import ParallelConfig, build_mesh
from omni_diffusion.parallel.config import offsets, split_sizes


def _outliers(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    mask = torch.rand(x.shape, generator=gen) < 0.01
    return torch.where(mask, x * 8.0, x)


def attention_case(rank, world, ulysses, ring, batch, text, image, heads, dim, text_first, seed):
    """SequenceParallelAttention against full attention on the same q/k/v."""
    from omni_diffusion.parallel.sequence_attention import SequenceGroups, SequenceParallelAttention, SequenceState

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (_outliers(torch.randn(batch, text + image, heads, dim, generator=gen), gen)
               for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).double() for x in (q, k, v))).transpose(1, 2).float()
    mesh = build_mesh(ParallelConfig(ulysses=ulysses, ring=ring, cfg=world // (ulysses * ring)), "cpu")
    groups = SequenceGroups.from_mesh(mesh)
    split = groups.split(image)
    assert split.sizes == tuple(split_sizes(image, groups.degree))
    start, mine = offsets(list(split.sizes))[groups.rank], split.sizes[groups.rank]
    assert (split.start, split.mine) == (start, mine)

    def local(x):
        if text_first:
            return torch.cat([x[:, :text], x[:, text + start: text + start + mine]], dim=1)
        return torch.cat([x[:, start:start + mine], x[:, image:]], dim=1)

    state = SequenceState(split=split, text_len=text)
    sp = SequenceParallelAttention(groups, state, joint=text > 0, text_first=text_first,
                                   backend="sdpa_math")
    out = sp(local(q), local(k), local(v))
    return (out - local(ref)).abs().max().item()


def pipeline_case(rank, world, family, config, steps=2, cfg=True, overrides=None):
    """A tiny pipeline, parallelized by ``config`` (a ParallelConfig dict), against
    the same pipeline run whole on this rank; returns (max abs diff, max |ref|)."""
    from omni_diffusion.parallel import parallelize
    from omni_diffusion.testing import output_tensor, tiny_call_kwargs, tiny_pipeline

    pipe = tiny_pipeline(family)
    overrides = overrides or {}

    def generate():
        kwargs = tiny_call_kwargs(family, steps=steps, cfg=cfg, pipe=pipe, **overrides)
        with torch.no_grad():
            return output_tensor(pipe(**kwargs)).float()

    # What the last block of the transformer receives on this rank: (batch, tokens) per call.
    from omni_diffusion.adapters import adapter_for

    spec, blocks = adapter_for(pipe).blocks(pipe.transformer)[-1]
    seen = []
    handle = blocks[-1].register_forward_pre_hook(
        lambda m, a, kw: seen.append(tuple(kw.get(spec.hidden_arg, a[0] if a else None).shape[:2])),
        with_kwargs=True)
    ref = generate()
    ref_seen, seen[:] = list(seen), []
    full_params = sum(p.numel() for p in pipe.transformer.parameters())
    undo = parallelize(pipe, ParallelConfig(**config), device_type="cpu")
    try:
        params = sum(p.numel() for p in pipe.transformer.parameters())
        out = generate()
    finally:
        handle.remove()
        undo()
    again = generate()  # undo restored the single-process model
    return dict(diff=(out - ref).abs().max().item(), scale=ref.abs().max().item(),
                after_undo=(again - ref).abs().max().item(), seen=seen, ref_seen=ref_seen,
                param_fraction=params / full_params)


def transformer_case(rank, world, family, config, options):
    """A tiny bare transformer (``omni_diffusion.testing.tiny_transformer(family, **options)``)
    parallelized by ``config``, against its single-process forward on the same inputs.
    Returns max abs diff, max |ref|, the diff after undo, and ``text_mask_effect``: how
    much the output moves when the text mask is replaced by all-True (None without a
    padded sample), which shows that the mask is exercised."""
    from omni_diffusion.parallel import parallelize
    from omni_diffusion.testing import tiny_transformer

    model, inputs = tiny_transformer(family, **options)
    mask_arg = "encoder_hidden_states_mask" if family == "qwen_image" else "encoder_attention_mask"

    def forward(**changes):
        with torch.no_grad():
            return model(**{**inputs, **changes})[0].float()

    ref = forward()
    mask = inputs.get(mask_arg)
    effect = None
    if mask is not None and not bool(mask.all()):
        effect = (forward(**{mask_arg: torch.ones_like(mask)}) - ref).abs().max().item()
    undo = parallelize(model, ParallelConfig(**config), device_type="cpu")
    try:
        out = forward()
    finally:
        undo()
    again = forward()
    return dict(diff=(out - ref).abs().max().item(), scale=ref.abs().max().item(),
                after_undo=(again - ref).abs().max().item(), text_mask_effect=effect)


def _without_parallel_plans(adapter):
    """An instance of ``adapter``'s class minus its sequence/tensor-parallel plans
    (a family that declares none); not registered."""
    cls = type(f"{type(adapter).__name__}WithoutPlans", (type(adapter),),
               {"sequence_parallel": None, "tensor_parallel": None})
    return cls()


def bad_config_case(rank, world, family, config, hide_vae_module=False, strip_plans=False):
    """The error a bad config raises (its message), checked to come before any collective.
    ``hide_vae_module``: behave as if ``omni_diffusion.vae_parallel`` were not installed;
    ``strip_plans``: use the family's adapter without its parallel plans."""
    import sys

    import torch.distributed as dist

    if hide_vae_module:
        sys.modules["omni_diffusion.vae_parallel"] = None  # find_spec answers None

    from omni_diffusion.adapters import adapter_for
    from omni_diffusion.parallel import parallelize
    from omni_diffusion.testing import tiny_pipeline

    pipe = tiny_pipeline(family)
    adapter = _without_parallel_plans(adapter_for(pipe)) if strip_plans else None
    # A collective only rank 0 would enter would hang the others: every rank
    # must fail at the same point, so each reports its own message.
    try:
        parallelize(pipe, ParallelConfig(**config), adapter=adapter, device_type="cpu")
    except (ValueError, ImportError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = None
    finally:
        if hide_vae_module:
            del sys.modules["omni_diffusion.vae_parallel"]
    dist.barrier()  # all ranks got here: nobody is stuck in a collective
    return message


def accelerate_case(rank, world, family, parallel, accel, call=None):
    """accelerate() with ``parallel`` composed with other features (``accel`` dict)
    against accelerate() with the same features on one process; ``call`` overrides
    tiny_call_kwargs' arguments (a smaller image, say)."""
    import omni_diffusion as od
    from omni_diffusion.testing import output_tensor, tiny_call_kwargs, tiny_pipeline

    pipe = tiny_pipeline(family)

    def generate():
        with torch.no_grad():
            return output_tensor(pipe(**tiny_call_kwargs(family, steps=2, pipe=pipe, **(call or {})))).float()

    od.accelerate(pipe, od.AccelConfig(**accel))
    ref = generate()
    od.accelerate(pipe, od.AccelConfig(parallel=parallel, **accel))
    out = generate()
    od.undo(pipe)
    return (out - ref).abs().max().item(), ref.abs().max().item()


def _op_counts(fn) -> dict[str, int]:
    """How many times each op (and collective) runs in ``fn()``, from torch.profiler on CPU."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    fn()  # first-call work (caches, lazy init) is not what is counted
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return dict(Counter(event.name for event in prof.events()))


def _transformer_forward(family):
    """A tiny ``family`` pipeline (omni attention ``sdpa_math``), its adapter and transformer,
    and a no-grad call of the transformer with the arguments its pipeline passed it at the
    first step; the call returns the output tensor."""
    import omni_diffusion as od
    from omni_diffusion.adapters import adapter_for
    from omni_diffusion.testing import tiny_call_kwargs, tiny_pipeline

    pipe = tiny_pipeline(family)
    od.accelerate(pipe, od.AccelConfig(attention="sdpa_math"))
    adapter = adapter_for(pipe)
    transformer = adapter.transformers(pipe)["transformer"]
    calls = []
    handle = transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(**tiny_call_kwargs(family, steps=1, pipe=pipe))
    finally:
        handle.remove()
    args, kwargs = calls[0]

    def forward():
        with torch.no_grad():
            out = transformer(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out.sample

    return pipe, adapter, transformer, forward


def _plain_and_degree_one(pipe, forward, measure, installed=lambda: None):
    """``(measure(forward) plainly, the same through the sequence-parallel path at degree 1
    (force_sequence_parallel), max |output difference|, installed() while the path is on)``."""
    from omni_diffusion.parallel import parallelize

    plain, ref = measure(forward), forward()
    undo = parallelize(pipe, ParallelConfig(), attention_backend="sdpa_math", device_type="cpu",
                       force_sequence_parallel=True)
    try:
        sp, out, seen = measure(forward), forward(), installed()
    finally:
        undo()
    return plain, sp, (out - ref).abs().max().item(), seen


def op_count_case(rank, world, family):
    """Ops of one transformer forward of a tiny ``family`` pipeline, plain and through the
    sequence-parallel path at degree 1 (``force_sequence_parallel``); (plain, sp, max |diff|)."""
    pipe, _, _, forward = _transformer_forward(family)
    return _plain_and_degree_one(pipe, forward, _op_counts)[:3]


def _python_calls(fn) -> int:
    """Python function calls (profiler "call" events: frames entered, builtins not
    counted) that one ``fn()`` makes, after a first call (caches, lazy init). The
    garbage collector is off while counting: finalizers would add calls at random."""
    import gc
    import sys

    fn()
    count = 0

    def profiler(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return count


def _block_hooks(adapter, transformer) -> int:
    """Forward hooks and pre-hooks on ``transformer``'s blocks (any one sends every call of
    its block through ``nn.Module.__call__``'s slow path)."""
    return sum(len(block._forward_pre_hooks) + len(block._forward_hooks)
               for _, blocks in adapter.blocks(transformer) for block in blocks)


def python_call_case(rank, world, family, depths):
    """Python calls of one transformer forward of a tiny ``family`` pipeline, plain and
    through the sequence-parallel path at degree 1, with each block list deepened to each
    of ``depths`` blocks; ``[(blocks, plain calls, sp calls, max |diff|, block hooks while
    the path is installed)]`` per depth."""
    pipe, adapter, transformer, forward = _transformer_forward(family)
    rows = []
    for depth in depths:
        _deepen(transformer, adapter, depth)
        blocks = sum(len(module_list) for _, module_list in adapter.blocks(transformer))
        rows.append((blocks, *_plain_and_degree_one(
            pipe, forward, _python_calls, lambda: _block_hooks(adapter, transformer))))
    return rows


def _deepen(transformer, adapter, blocks_per_list: int) -> None:
    """Copies of each block list's first block after it, up to ``blocks_per_list`` blocks
    (the last block, which may differ, stays last)."""
    import copy

    for _, blocks in adapter.blocks(transformer):
        while len(blocks) < blocks_per_list:
            blocks.insert(1, copy.deepcopy(blocks[0]))


def _image_shares(transformer) -> set[tuple[int, int]]:
    """``(image tokens held, image tokens in all)`` of each sequence-parallel attention's
    last forward (routed through diffusers' dispatcher), to show the work was split."""
    from omni_diffusion.parallel.sequence_attention import SequenceParallelAttention

    shares = set()
    for module in transformer.modules():
        parallel = getattr(getattr(module, "processor", None), "_parallel_config", None)
        if isinstance(parallel, SequenceParallelAttention) and parallel.state.split is not None:
            shares.add((parallel.state.split.mine, parallel.state.split.total))
    return shares


def _is_compiled(fn) -> bool:
    """Whether ``fn`` is what ``torch.compile`` returned for a function or method."""
    return hasattr(fn, "_torchdynamo_orig_callable")


def compile_case(rank, world, family, parallels, backend, blocks_per_list, recompile_limit):
    """Regional compile (``compile_backend=backend``) on its own (degree 1) and composed
    with each ParallelConfig dict of ``parallels``, against the uncompiled single-process
    output, on a tiny ``family`` pipeline whose block lists hold ``blocks_per_list``
    blocks. Dynamo may compile each code object at most ``recompile_limit`` times (a hit
    fails the run), so a block recompiled per block instance fails. Returns, per run
    ("degree1", then ``parallels``' indices): max abs diff, max |ref|, Dynamo's graph
    count, how the blocks were compiled, the image shares, what undo left."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import omni_diffusion as od
    from omni_diffusion.adapters import adapter_for
    from omni_diffusion.testing import output_tensor, tiny_call_kwargs, tiny_pipeline

    pipe = tiny_pipeline(family)
    adapter = adapter_for(pipe)
    _deepen(pipe.transformer, adapter, blocks_per_list)
    blocks = [b for _, blocks in adapter.blocks(pipe.transformer) for b in blocks]

    def generate():
        with torch.no_grad():
            return output_tensor(pipe(**tiny_call_kwargs(family, steps=2, pipe=pipe))).float()

    od.accelerate(pipe, od.AccelConfig(attention="sdpa_math"))
    ref = generate()
    limits = (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit)
    torch._dynamo.config.recompile_limit = recompile_limit
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    runs = {}
    try:
        for label, config in [("degree1", None), *enumerate(parallels)]:
            torch._dynamo.reset()
            counters.clear()
            od.accelerate(pipe, od.AccelConfig(attention="sdpa_math", parallel=config, compile=True,
                                               compile_backend=backend))
            out = generate()
            runs[label] = dict(
                diff=(out - ref).abs().max().item(), scale=ref.abs().max().item(),
                graphs=counters["stats"]["unique_graphs"],
                call_compiled=all(b._compiled_call_impl is not None for b in blocks),
                forward_compiled=all("forward" in b.__dict__ for b in blocks),
                # a sequence-parallel forward wrapper's wrapped forward is compiled
                inner_compiled=all(_is_compiled(getattr(b.__dict__.get("forward"), "inner", None))
                                   for b in blocks),
                block_hooks=_block_hooks(adapter, pipe.transformer),
                image_shares=_image_shares(pipe.transformer))
            od.undo(pipe)
            runs[label]["undone"] = all(b._compiled_call_impl is None and "forward" not in b.__dict__
                                        and not b._forward_pre_hooks for b in blocks)
    finally:
        torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit = limits
        torch._dynamo.reset()
    return runs


def compile_undo_order_case(rank, world, compile_undone_first):
    """A tiny Qwen-Image transformer through the sequence-parallel path at degree 1, then
    regional compile (``compile_backend="eager"``), undone in either order. One block
    carries an instance ``forward`` of its own beforehand, which must come back as it
    was. Returns: max |diff| compiled and after both undos (against the plain forward),
    whether every block's wrapped forward was compiled, whether each block's instance
    ``forward`` is the same object as before (or again absent), and the block hooks left."""
    import functools

    from omni_diffusion.accelerate import AccelConfig
    from omni_diffusion.adapters import adapter_for_transformer
    from omni_diffusion.compile import apply_compile
    from omni_diffusion.parallel import parallelize
    from omni_diffusion.testing import tiny_transformer

    model, inputs = tiny_transformer("qwen_image")
    adapter = adapter_for_transformer(model)
    blocks = [b for _, blocks in adapter.blocks(model) for b in blocks]
    blocks[0].forward = functools.partial(type(blocks[0]).forward, blocks[0])
    missing = object()
    before = [b.__dict__.get("forward", missing) for b in blocks]

    def forward():
        with torch.no_grad():
            return model(**inputs)[0].float()

    ref = forward()
    undo_parallel = parallelize(model, ParallelConfig(), attention_backend="sdpa_math",
                                device_type="cpu", force_sequence_parallel=True)
    undo_compile = apply_compile(model, adapter, AccelConfig(compile=True, compile_backend="eager"))
    try:
        compiled = forward()
        inner_compiled = all(_is_compiled(getattr(b.__dict__.get("forward"), "inner", None))
                             for b in blocks)
    finally:
        for undo in ((undo_compile, undo_parallel) if compile_undone_first
                     else (undo_parallel, undo_compile)):
            undo()
    restored = [b.__dict__.get("forward", missing) is previous for b, previous in zip(blocks, before)]
    return dict(diff=(compiled - ref).abs().max().item(), scale=ref.abs().max().item(),
                after_undo=(forward() - ref).abs().max().item(), inner_compiled=inner_compiled,
                restored=restored, block_hooks=_block_hooks(adapter, model))


def vae_parallel_undo_case(rank, world):
    """accelerate() with Ulysses and spatial VAE parallelism on a tiny Flux, then undo().
    Returns whether undo raised, what it left behind (the VAE's parallel mode, blocks with
    an instance ``forward``), and whether the pipeline accelerates again."""
    import omni_diffusion as od
    from omni_diffusion.adapters import adapter_for
    from omni_diffusion.testing import tiny_pipeline
    from omni_diffusion.vae_parallel import vae_parallel_mode

    pipe = tiny_pipeline("flux")
    blocks = [b for _, blocks in adapter_for(pipe).blocks(pipe.transformer) for b in blocks]
    od.accelerate(pipe, od.AccelConfig(attention="sdpa_math", parallel=od.ParallelConfig(
        ulysses=2, vae=2, vae_mode="spatial")))
    installed = dict(vae_mode=vae_parallel_mode(pipe.vae),
                     wrapped_blocks=sum("forward" in b.__dict__ for b in blocks))
    try:
        od.undo(pipe)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    left = dict(vae_mode=vae_parallel_mode(pipe.vae), wrapped_blocks=sum("forward" in b.__dict__ for b in blocks))
    od.accelerate(pipe, od.AccelConfig(attention="sdpa_math"))  # refused while half-undone
    od.undo(pipe)
    return dict(installed=installed, error=error, left=left)


def vae_only_case(rank, world, vae, vae_mode):
    """accelerate() with ``ParallelConfig(vae=vae)`` alone (the transformer replicated on every
    rank) against the same pipeline decoded whole; returns (max abs diff, max |ref|, the VAE's
    parallel mode while accelerated, the VAE group's size)."""
    import omni_diffusion as od
    from omni_diffusion.testing import output_tensor, tiny_call_kwargs, tiny_pipeline
    from omni_diffusion.vae_parallel import vae_parallel_mode

    pipe = tiny_pipeline("flux")

    def generate():
        with torch.no_grad():
            kwargs = tiny_call_kwargs("flux", steps=2, pipe=pipe, output_type="pt")
            return output_tensor(pipe(**kwargs)).float()

    ref = generate()
    od.accelerate(pipe, od.AccelConfig(attention="sdpa_math", parallel=od.ParallelConfig(vae=vae, vae_mode=vae_mode)))
    try:
        out, mode = generate(), vae_parallel_mode(pipe.vae)
    finally:
        od.undo(pipe)
    return (out - ref).abs().max().item(), ref.abs().max().item(), mode
