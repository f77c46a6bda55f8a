"""Tests of omni_diffusion.attention.policy: which attention calls stay in full precision.

A small stand-in transformer (two blocks, each with an attention module shaped
as diffusers' ``Attention``: ``processor`` + ``set_processor``) records, per
attention call, the backend omni's dispatch would run (``select_backend``), and
a stand-in scheduler gives ``step_index`` / ``timesteps`` as diffusers' do.
"""

from __future__ import annotations

import pytest
import torch

from omni_diffusion.attention.policy import (
    FullPrecisionPolicy,
    apply_attention_policy,
    attention_modules,
)
from omni_kernels.attention import select_backend


class _Attention(torch.nn.Module):
    def __init__(self, log):
        super().__init__()
        self.processor = None
        self.log = log

    def set_processor(self, processor):
        self.processor = processor

    def forward(self, x):
        if not torch.isfinite(x).all():
            raise RuntimeError("non-finite input")  # an error inside the hooked forward
        name, reason = select_backend(x, x, x)
        self.log.append(name or reason)
        return x


class _Block(torch.nn.Module):
    def __init__(self, log):
        super().__init__()
        self.attn = _Attention(log)

    def forward(self, x):
        return self.attn(x)


class _Transformer(torch.nn.Module):
    def __init__(self, log, blocks=2):
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(_Block(log) for _ in range(blocks))

    def forward(self, x):
        for block in self.transformer_blocks:
            x = block(x)
        return x


class _Scheduler:
    def __init__(self, steps):
        self.timesteps = torch.linspace(1.0, 0.0, steps)
        self.step_index = None


class _Pipe:
    def __init__(self, log, steps):
        self.transformer = _Transformer(log)
        self.scheduler = _Scheduler(steps)


def _x():
    return torch.randn(1, 2, 16, 64)  # omni_sage takes it on CPU (Triton interpreter)


def _denoise(pipe, steps):
    x = _x()
    for i in range(steps):
        pipe.transformer(x)
        pipe.scheduler.step_index = i + 1  # what scheduler.step() does


def test_steps_and_layers():
    log: list[str] = []
    pipe = _Pipe(log, steps=5)
    policy = FullPrecisionPolicy(quantized_backend="omni_sage", first_steps=1, last_steps=1,
                                 full_precision_layers=(-1,))
    handle = apply_attention_policy(pipe, policy)
    _denoise(pipe, 5)
    exact = select_backend(_x(), _x(), _x(), backend="auto", allow_lossy=False)[0]
    assert exact != "omni_sage"
    per_step = [log[i:i + 2] for i in range(0, len(log), 2)]
    assert per_step[0] == [exact, exact]  # first step
    assert per_step[4] == [exact, exact]  # last step
    for step in per_step[1:4]:
        assert step == ["omni_sage", exact]  # last block always exact
    handle.remove()
    log.clear()
    pipe.transformer(_x())
    assert "omni_sage" not in log, "after remove(), nothing lossy unless asked"


def test_pattern_layers_and_plain_model():
    log: list[str] = []
    model = _Transformer(log, blocks=3)
    assert [n for n, _ in attention_modules(model)] == [f"transformer_blocks.{i}.attn" for i in range(3)]
    apply_attention_policy(model, FullPrecisionPolicy(quantized_backend="omni_sage",
                                                      full_precision_layers=("transformer_blocks.1.*",)))
    model(_x())
    assert log[0] == "omni_sage" and log[1] != "omni_sage" and log[2] == "omni_sage"


def test_context_restored_after_an_error():
    log: list[str] = []
    model = _Transformer(log)
    apply_attention_policy(model, FullPrecisionPolicy(quantized_backend="omni_sage"))
    with pytest.raises(RuntimeError, match="non-finite"):
        model(torch.full((1, 2, 16, 64), float("nan")))
    assert not log
    assert select_backend(_x(), _x(), _x())[0] != "omni_sage"


def test_auto_default_quantizes_only_past_the_measured_crossover(tmp_path, monkeypatch):
    """The default quantized_backend="auto": on an arch whose auto table lists no lossy
    backend every call stays exact; where the table lists one with a crossover, calls past
    it run the lossy backend and shorter ones the exact first choice."""
    import json

    from omni_kernels.attention import ENV_AUTO_TABLE, reload_auto_table

    assert FullPrecisionPolicy().quantized_backend == "auto"
    log: list[str] = []
    model = _Transformer(log, blocks=2)
    handle = apply_attention_policy(model, FullPrecisionPolicy(full_precision_layers=(-1,)))
    model(_x())
    assert "omni_sage" not in log  # the shipped table lists no lossy backend for the CPU
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"archs": {"cpu": {
        "ranking": ["omni_sage", "sdpa_math"], "lossy_min_seq": {"omni_sage": 16}}}}))
    monkeypatch.setenv(ENV_AUTO_TABLE, str(table))
    reload_auto_table()
    try:
        log.clear()
        model(_x())  # 16 tokens: at the crossover
        assert log == ["omni_sage", "sdpa_math"]  # the last block is kept exact
        log.clear()
        model(torch.randn(1, 2, 15, 64))  # below it
        assert log == ["sdpa_math", "sdpa_math"]
    finally:
        handle.remove()
        monkeypatch.delenv(ENV_AUTO_TABLE)
        reload_auto_table()


def test_bad_policies():
    with pytest.raises(ValueError, match="lossless"):
        FullPrecisionPolicy(quantized_backend="sdpa_math")
    with pytest.raises(ValueError, match="is lossy"):
        FullPrecisionPolicy(full_precision_backend="omni_sage")
    with pytest.raises(ValueError, match="unknown attention backend"):
        FullPrecisionPolicy(quantized_backend="nope")
    with pytest.raises(ValueError, match="first_steps"):
        FullPrecisionPolicy(first_steps=-1)
    log: list[str] = []
    with pytest.raises(ValueError, match="out of range"):
        apply_attention_policy(_Transformer(log), FullPrecisionPolicy(full_precision_layers=(5,)))
    with pytest.raises(ValueError, match="matches no attention module"):
        apply_attention_policy(_Transformer(log), FullPrecisionPolicy(full_precision_layers=("x*",)))
    with pytest.raises(ValueError, match="scheduler"):
        apply_attention_policy(_Transformer(log), FullPrecisionPolicy(first_steps=1))
