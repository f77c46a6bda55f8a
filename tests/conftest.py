"""Shared test setup: the Triton interpreter on CPU, the ``gpu`` marker, inputs and error metrics.

Without a GPU, Triton kernels run on CPU tensors under Triton's interpreter,
which must be switched on before ``triton`` is first imported; pytest loads
this file before any test module, so it is set here. Tests marked ``gpu`` are
skipped on such machines.
"""

from __future__ import annotations

import collections
import contextlib
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    # Importing torch does not import triton; nothing has read the variable yet.
    os.environ.setdefault("TRITON_INTERPRET", "1")

GPU_SKIP_REASON = "needs an NVIDIA GPU (CUDA); torch.cuda.is_available() is False"


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml registers the marker too; registering it here keeps
    # `--strict-markers` happy when the tests run from another root.
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (CUDA); skipped without one")


#: test folders whose files share session-wide state (tests/parallel: its gloo worker pools)
ONE_WORKER_DIRS = ("tests/parallel/",)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unused without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``pytest -n N --dist loadfile`` (``make test``): each test file runs whole, in order, in
    one worker, so that its module fixtures (servers, vLLM, bench runs) start once; and each
    folder of ONE_WORKER_DIRS runs whole in one worker, which then starts its pools once."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileOrFolderScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return next((folder for folder in ONE_WORKER_DIRS if path.startswith(folder)), path)

    return FileOrFolderScheduling(config, log)


def _name_params_in_shared_node_ids(items: list[pytest.Item]) -> None:
    """pytest 9 builds an item's node id from its function's name and its parametrize ids, so
    schemathesis' items (one per API operation, named ``test[GET /path]``, no parametrize ids)
    all share one id; pytest-xdist schedules by node id and so would run only the first. Each
    such item gets the bracket of its name in its id, as under pytest 8."""
    counts = collections.Counter(item.nodeid for item in items)
    for item in items:
        params = item.name.removeprefix(getattr(item, "originalname", item.name))
        if counts[item.nodeid] > 1 and params.startswith("[") and params.endswith("]"):
            item._id = item._id.with_params(params[1:-1])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _name_params_in_shared_node_ids(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# --------------------------------------------------------------------------- helpers


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius norms), computed in float64.

    On CUDA the difference is formed chunk by chunk so that a float64 copy of a
    multi-GB activation is never materialized.
    """
    out = out.reshape(-1)
    ref = ref.reshape(-1)
    if out.numel() != ref.numel():
        raise ValueError(f"shape mismatch: {out.numel()} vs {ref.numel()} elements")
    chunk = 1 << 24
    err_sq = 0.0
    ref_sq = 0.0
    for start in range(0, out.numel(), chunk):
        o = out[start : start + chunk].double()
        r = ref[start : start + chunk].double()
        err_sq += torch.sum((o - r) ** 2).item()
        ref_sq += torch.sum(r * r).item()
    if ref_sq == 0.0:
        return 0.0 if err_sq == 0.0 else float("inf")
    return (err_sq / ref_sq) ** 0.5


class InputFactory:
    """Random test inputs with the statistics of real DiT activations.

    Each test gets its own factory, seeded from the test's node id: inputs are
    fresh for every test (no shared or all-zero tensors) and a failure
    reproduces when the test is re-run alone.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device | str) -> torch.Generator:
        device = torch.device(device)
        key = str(device)
        if key not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[key] = gen
        return self._generators[key]

    def activations(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        outlier_channels: int | None = None,
    ) -> torch.Tensor:
        """``randn(shape)`` with a few outlier channels in the last dimension.

        Projections in DiTs have a handful of channels (the same ones at every
        token and head) 10-30x larger than the rest; they dominate the sum of
        squares and so exercise the reduction's accuracy. 2-4 channels are
        scaled by factors drawn from [10, 30].
        """
        gen = self.generator(device)
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        dim = shape[-1]
        if outlier_channels is None:
            outlier_channels = int(torch.randint(2, 5, (1,), generator=gen, device=device).item())
        outlier_channels = min(outlier_channels, dim)
        channels = torch.randperm(dim, generator=gen, device=device)[:outlier_channels]
        scales = 10.0 + 20.0 * torch.rand(outlier_channels, generator=gen, device=device)
        x[..., channels] *= scales
        return x.to(dtype)

    def weight(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """An RMSNorm weight ``[numel]``: around 1 with spread, as trained weights are."""
        gen = self.generator(device)
        w = 1.0 + 0.5 * torch.randn(numel, generator=gen, device=device, dtype=torch.float32)
        return w.to(dtype)

    def rope_tables(
        self,
        seq: int,
        head_dim: int,
        interleaved: bool,
        device: torch.device | str = "cpu",
        paired: bool = True,
        theta: float = 10000.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[S, D]`` float32 contiguous.

        ``paired=True`` builds them as diffusers does: angle ``pos * theta**(-2i/D)``
        for pair ``i``, positions a random offset into the sequence (a frame or
        row of a 3-D grid), each value repeated for both members of its pair
        (adjacent for ``interleaved``, ``D/2`` apart otherwise). ``paired=False``
        gives unrelated random angles for every element, which checks that a
        kernel reads each element's own table entry, as the reference does.
        """
        gen = self.generator(device)
        if not paired:
            angles = 6.3 * torch.rand(seq, head_dim, generator=gen, device=device)
            return torch.cos(angles), torch.sin(angles)
        start = float(torch.randint(0, 64, (1,), generator=gen, device=device).item())
        pos = start + torch.arange(seq, device=device, dtype=torch.float64)
        inv_freq = theta ** (
            -torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
        )
        angles = pos[:, None] * inv_freq[None, :]  # [S, D/2]
        if interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        return torch.cos(angles).float().contiguous(), torch.sin(angles).float().contiguous()


def qk_reference_upcast(
    q, k, q_weight, k_weight, cos, sin, *, eps, interleaved, norm_across_heads, dtype=torch.float64
):
    """The reference evaluated on inputs upcast to ``dtype`` (float64 on CPU, float32 on GPU).

    Returns ``(q_ref, k_ref)`` in ``dtype``: the exact result before the final
    rounding, so an error measured against it is the kernel's own.
    """
    from omni_kernels.qk_norm_rope.reference import qk_rmsnorm_rope_reference

    def up(t):
        return None if t is None else t.to(dtype)

    return qk_rmsnorm_rope_reference(
        up(q), up(k), up(q_weight), up(k_weight), up(cos), up(sin),
        eps=eps, interleaved=interleaved, norm_across_heads=norm_across_heads,
    )


@contextlib.contextmanager
def outputs_allocated_poisoned():
    """``torch.empty`` returns tensors filled with 0xFF bytes (int8 -1, float32 NaN) while this is
    active: an element a kernel fails to write shows up even where the allocator hands back the
    memory of an earlier, correct output."""
    allocate = torch.empty

    def poisoned(*args, **kwargs):
        out = allocate(*args, **kwargs)
        if out.numel():
            out.view(torch.uint8).fill_(0xFF)
        return out

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = allocate


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def inputs(request: pytest.FixtureRequest) -> InputFactory:
    """A fresh :class:`InputFactory` seeded from this test's node id."""
    return InputFactory(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def rel_err():
    """:func:`relative_error`: ``||out - ref|| / ||ref||`` in float64."""
    return relative_error


@pytest.fixture
def poisoned_outputs():
    """:func:`outputs_allocated_poisoned`, the context manager (``with poisoned_outputs(): ...``)."""
    return outputs_allocated_poisoned


@pytest.fixture
def qk_reference():
    """:func:`qk_reference_upcast`: the reference on upcast inputs."""
    return qk_reference_upcast
