"""bench/quant_activation_tune.py on the CPU: the settings list, the table, and the refusal
without a GPU (the timings themselves need one)."""

from __future__ import annotations


import pytest
import torch



@pytest.fixture(scope="module")
def tune():
    from bench import quant_activation_tune

    return quant_activation_tune


def test_settings_start_with_the_default_and_are_launcher_options(tune):
    import inspect

    from omni_kernels.quant.activated_triton_kernel import launch_quantize_activated_triton

    labels = [label for label, _ in tune.settings(tune.SHAPES["tiny"])]
    assert labels[0] == "tile-8w-keep" and len(labels) == len(set(labels))
    allowed = set(inspect.signature(launch_quantize_activated_triton).parameters)
    assert all(set(options) <= allowed for _, options in tune.settings(tune.SHAPES["tiny"]))


def test_markdown_table(tune):
    env = dict(device="NVIDIA H200", torch="2.11", cuda="13.0", packages={"triton": "3.6"}, git_commit="abc",
               utc="now", command="python3 bench/quant_activation_tune.py")
    shape = tune.SHAPES["tiny"]
    rows = [dict(shape="tiny", setting="tile-8w-keep", us=10.0, gbps=100.0, status="ok"),
            dict(shape="tiny", setting="tile-16w-recompute", us=8.0, gbps=125.0, status="ok"),
            dict(shape="tiny", setting="chunked-2048-4w", status="error: out of resources")]
    table = tune.markdown(env, [shape], rows, "bf16")
    assert "| tile-16w-recompute | 8.0 | 125 | 1.25x | ok |" in table
    assert "| chunked-2048-4w | - | - | - | error: out of resources |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(tune, capsys):
    assert tune.main(["--shapes", "tiny"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err

