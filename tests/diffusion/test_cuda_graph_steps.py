"""``AccelConfig(cuda_graphs=True)`` marks a CUDA-graph step at every transformer forward.

CUDA graphs need a GPU (``bench/pipeline.py`` variant (d4) runs them on one); on the CPU
the step-marking hook itself is checked: one mark per forward, none after its undo.
"""

from __future__ import annotations

import torch
from torch import nn

from omni_diffusion.compile import mark_graph_steps


def test_one_step_mark_per_forward_and_undo(monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    x = torch.randn(2, 4)
    undo = mark_graph_steps(model)
    expected = model(x)
    model(x)
    assert len(marks) == 2
    undo()
    assert torch.equal(model(x), expected) and len(marks) == 2
    assert not model._forward_pre_hooks
