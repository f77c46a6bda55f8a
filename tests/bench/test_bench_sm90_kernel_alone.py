"""bench/sm90_kernel_alone.py's command line (the timing itself needs an sm_90 GPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def sm90_kernel_alone():
    from bench import sm90_kernel_alone

    return sm90_kernel_alone


def test_unknown_shape_is_refused(sm90_kernel_alone, capsys):
    with pytest.raises(SystemExit) as exc:
        sm90_kernel_alone.main(["tag", "--shapes", "flux,nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--shapes must name some of" in err and "'flux,nope'" in err


def test_empty_shape_list_is_refused(sm90_kernel_alone, capsys):
    with pytest.raises(SystemExit) as exc:
        sm90_kernel_alone.main(["tag", "--shapes", ","])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_it_says_so(sm90_kernel_alone, capsys):
    assert sm90_kernel_alone.main(["tag", "--shapes", "flux"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
