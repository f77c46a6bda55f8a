"""Attention backend registry: selection, errors, SDPA backends, patch_sdpa, the custom op.

CPU tests run omni's Triton kernel under Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 without a GPU), on small shapes. GPU tests (marked
``gpu``) check every backend that loads against the float32 reference, at one
real DiT shape and on each feature the backend declares.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import omni_kernels.attention as A
from omni_kernels.attention import selection
from omni_kernels.attention.spec import _arch_of
from omni_kernels import _packages
from omni_kernels.attention.reference import attention_reference

HAS_TRITON_FLASH = importlib.util.find_spec("omni_kernels.attention.triton_flash") is not None
needs_triton_flash = pytest.mark.skipif(
    not HAS_TRITON_FLASH, reason="omni_kernels/attention/triton_flash.py is not there yet"
)
ON_CPU_INTERPRETER = not torch.cuda.is_available()

EXPECTED = {
    "omni_triton", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math",
    "flash_attn", "flash_attn3", "flashinfer", "sageattention", "xformers",
}


@pytest.fixture(autouse=True)
def _clean_selection_state(monkeypatch):
    monkeypatch.delenv(A.ENV_BACKEND, raising=False)
    monkeypatch.delenv(A.ENV_ALLOW_LOSSY, raising=False)
    monkeypatch.delenv(A.ENV_AUTO_TABLE, raising=False)
    selection.reload_auto_table()
    yield
    selection.reload_auto_table()
    selection._TRACED_CHOICES.clear()
    selection._WARNED_CHOICES.clear()


def _qkv(shape_q, shape_kv, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(shape_q, generator=gen, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn(shape_kv, generator=gen, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(shape_kv, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return q, k, v


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


class _Spy:
    """A CPU backend that records its calls and returns zeros (plus an offset)."""

    def __init__(self, offset):
        self.calls = 0
        self.offset = offset

    def __call__(self, q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
        self.calls += 1
        out = torch.full_like(q, float(self.offset))
        return (out, torch.zeros(q.shape[:3], dtype=torch.float32)) if return_lse else out


@pytest.fixture
def spies():
    made = {}
    for name, offset, extra in (
        ("spy_a", 1, {}),
        ("spy_b", 2, {}),
        ("spy_lossy", 3, {"lossy": True}),
        ("spy_sage", 4, {"head_dims": (64, 128), "lossy": True}),
        ("spy_fp16", 5, {"dtypes": (torch.float16,)}),
        ("spy_missing", 6, {"availability": lambda d: "the 'spy' package is not installed (pip install spy)"}),
    ):
        run = _Spy(offset)
        A.register_backend(A.BackendSpec(
            name=name, run=run, devices=("cpu", "cuda"), dtypes=extra.pop("dtypes", (torch.float32,)),
            head_dims=extra.pop("head_dims", None), layouts=("bhsd",), **extra,
        ))
        made[name] = run
    yield made
    for name in made:
        A.unregister_backend(name)


# --------------------------------------------------------------------------- registry


def test_builtin_backends_registered_with_specs():
    names = set(A.list_backends())
    assert EXPECTED <= names
    assert A.get_backend("sageattention").lossy
    assert not any(A.get_backend(n).lossy for n in EXPECTED - {"sageattention"})
    assert A.get_backend("sdpa_cudnn").layouts == ("bhsd",)
    assert A.get_backend("flash_attn").layouts == ("bshd",)
    status = A.backend_status("cpu")
    assert status["sdpa_math"] is None
    assert "cuda" in status["sdpa_cudnn"]
    for name, reason in status.items():
        assert reason is None or isinstance(reason, str), name


def test_unknown_backend_lists_names():
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    with pytest.raises(ValueError, match="unknown attention backend 'nope'") as info:
        A.attention(q, k, v, backend="nope")
    for name in ("auto", "omni_triton", "sdpa_cudnn", "sdpa_math", "sageattention"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="unknown attention backend"):
        with A.attention_backend("nope"):
            pass
    with pytest.raises(ValueError, match="'auto' is a policy"):
        A.get_backend("auto")


def test_unknown_backend_from_env(monkeypatch):
    monkeypatch.setenv(A.ENV_BACKEND, "nope")
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    with pytest.raises(ValueError, match="from OMNI_ATTENTION_BACKEND"):
        A.attention(q, k, v)


def test_precedence_explicit_context_env_auto(monkeypatch, spies):
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    assert A.select_backend(q, k, v) == ("sdpa_math", None)  # auto on CPU: the cpu table
    monkeypatch.setenv(A.ENV_BACKEND, "spy_a")
    assert A.attention(q, k, v)[0, 0, 0, 0].item() == 1
    with A.attention_backend("spy_b"):
        assert A.attention(q, k, v)[0, 0, 0, 0].item() == 2  # context beats env
        assert A.attention(q, k, v, backend="spy_a")[0, 0, 0, 0].item() == 1  # argument beats context
        assert A.select_backend(q, k, v, backend="auto") == ("sdpa_math", None)  # explicit auto
        with A.attention_backend("auto"):
            assert A.select_backend(q, k, v) == ("sdpa_math", None)
        assert A.select_backend(q, k, v) == ("spy_b", None)  # nested context restored
    assert A.select_backend(q, k, v) == ("spy_a", None)  # back to env
    monkeypatch.delenv(A.ENV_BACKEND)
    assert A.select_backend(q, k, v) == ("sdpa_math", None)
    assert spies["spy_a"].calls == 2 and spies["spy_b"].calls == 1


def test_context_is_thread_local(spies):
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    seen = {}

    def other():
        seen["other"] = A.select_backend(q, k, v)[0]

    with A.attention_backend("spy_a"):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        seen["this"] = A.select_backend(q, k, v)[0]
    assert seen == {"this": "spy_a", "other": "sdpa_math"}


def test_ineligible_constraint_messages(spies):
    q, k, v = _qkv((1, 2, 8, 256), (1, 2, 8, 256))
    with pytest.raises(ValueError) as info:
        A.attention(q, k, v, backend="spy_sage")
    assert str(info.value) == "backend='spy_sage' cannot take head_dim=256: supports (64, 128)"
    with pytest.raises(ValueError, match=r"backend='spy_fp16' cannot take dtype=float32: supports \(float16\)"):
        A.attention(q, k, v, backend="spy_fp16")
    with pytest.raises(ValueError, match=r"backend='spy_missing' is not available: the 'spy' package is not installed"):
        A.attention(q, k, v, backend="spy_missing")
    with pytest.raises(ValueError, match=r"backend='sdpa_cudnn' cannot run on device cpu: runs on cuda"):
        A.attention(q, k, v, backend="sdpa_cudnn")
    with A.attention_backend("spy_fp16"):
        with pytest.raises(ValueError, match=r"spy_fp16' \(from attention_backend\(\) context\)"):
            A.attention(q, k, v)
    with pytest.raises(ValueError, match="sdpa_flash' cannot take key_lengths"):
        A.attention(q, k, v, backend="sdpa_flash", key_lengths=torch.tensor([3]))


def test_forward_only_backend_rejects_grad(spies):
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="is forward-only"):
        A.attention(q, k, v, backend="spy_a")
    with torch.no_grad():
        A.attention(q, k, v, backend="spy_a")
    out = A.attention(q, k, v)  # auto: sdpa_math has a backward
    out.sum().backward()
    assert q.grad is not None


def test_missing_package_and_broken_extension_reasons(tmp_path, monkeypatch):
    _packages._IMPORTS.pop("omni_no_such_pkg", None)
    module, reason = _packages.lazy_import("omni_no_such_pkg", "omni-no-such-pkg", "pip install omni-no-such-pkg")
    assert module is None and reason == (
        "the 'omni-no-such-pkg' package is not installed (pip install omni-no-such-pkg)"
    )
    (tmp_path / "omni_broken_ext.py").write_text(
        "raise ImportError('libfoo.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _packages._IMPORTS.pop("omni_broken_ext", None)
    module, reason = _packages.lazy_import("omni_broken_ext", "omni-broken-ext", "pip install it")
    assert module is None
    assert "failed to load" in reason and "undefined symbol" in reason and "built for another torch" in reason
    sys.modules.pop("omni_broken_ext", None)


def test_third_party_backends_report_why_not_on_this_machine():
    for name in ("flash_attn", "flash_attn3", "flashinfer", "sageattention", "xformers"):
        spec = A.get_backend(name)
        reason = spec.unavailable_reason()
        if reason is None:
            continue
        assert isinstance(reason, str) and reason, name
        if not torch.cuda.is_available():
            assert "CUDA" in reason


def test_lossy_backend_needs_table_and_permission(tmp_path, monkeypatch, spies):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"archs": {"cpu": {"ranking": ["spy_lossy", "sdpa_math"]}}}))
    monkeypatch.setenv(A.ENV_AUTO_TABLE, str(table))
    selection.reload_auto_table()
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    assert A.select_backend(q, k, v)[0] == "sdpa_math"  # lossy not allowed by default
    assert A.select_backend(q, k, v, allow_lossy=True)[0] == "spy_lossy"
    with A.attention_backend("auto", allow_lossy=True):
        assert A.select_backend(q, k, v)[0] == "spy_lossy"
    monkeypatch.setenv(A.ENV_ALLOW_LOSSY, "1")
    assert A.select_backend(q, k, v)[0] == "spy_lossy"
    assert A.select_backend(q, k, v, allow_lossy=False)[0] == "sdpa_math"
    # A lossy backend the table does not list is never auto-chosen, even when allowed.
    table.write_text(json.dumps({"archs": {"cpu": {"ranking": ["spy_a"]}}}))
    selection.reload_auto_table()
    ranking = A.auto_ranking("cpu", allow_lossy=True)
    assert ranking[0] == "spy_a" and "spy_lossy" not in ranking and "sageattention" not in ranking
    # The shipped table: a lossy backend appears for an arch only where that arch lists it.
    monkeypatch.delenv(A.ENV_AUTO_TABLE)
    selection.reload_auto_table()
    archs = A.load_auto_table()["archs"]
    for arch in ("sm90", "sm80"):
        listed = archs.get(arch, archs["cuda_default"])["ranking"]
        assert "sageattention" not in A.auto_ranking(arch)
        assert ("sageattention" in A.auto_ranking(arch, allow_lossy=True)) == ("sageattention" in listed)
    lossless_first = next(n for n in archs["sm90"]["ranking"] if not A.get_backend(n).lossy)
    assert A.auto_ranking("sm90")[0] == lossless_first
    # sm90's lossy backends carry their measured crossovers, each a listed lossy backend
    for name, length in A.lossy_min_seq("sm90").items():
        assert name in archs["sm90"]["lossy_listed"] and A.get_backend(name).lossy and length > 1
    assert A.auto_ranking("cpu")[:2] == ["sdpa_math", "omni_triton"]
    source = A.load_auto_table()["archs"]["sm90"]["source"]
    assert "ANCHORS" in source or "MEASURED" in source


def test_lossy_crossover_gates_auto_by_sequence_length(tmp_path, monkeypatch, spies, caplog):
    """A lossy backend with a measured crossover (lossy_min_seq) is auto-chosen only when
    min(Sq, Skv) reaches it; below, auto takes the next backend and says why; a named
    request ignores the rule, and a malformed entry is a clear error."""
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"archs": {"cpu": {
        "ranking": ["spy_lossy", "sdpa_math"], "lossy_min_seq": {"spy_lossy": 12}}}}))
    monkeypatch.setenv(A.ENV_AUTO_TABLE, str(table))
    selection.reload_auto_table()
    assert A.lossy_min_seq("cpu") == {"spy_lossy": 12}
    short = _qkv((1, 2, 11, 16), (1, 2, 11, 16))
    long = _qkv((1, 2, 12, 16), (1, 2, 12, 16))
    cross = _qkv((1, 2, 40, 16), (1, 2, 8, 16))  # many queries, few keys: the keys decide
    assert A.select_backend(*long, allow_lossy=True)[0] == "spy_lossy"
    assert A.select_backend(*short, allow_lossy=True)[0] == "sdpa_math"
    assert A.select_backend(*cross, allow_lossy=True)[0] == "sdpa_math"
    assert A.select_backend(*long)[0] == "sdpa_math"  # lossy still needs permission
    assert A.select_backend(*short, backend="spy_lossy")[0] == "spy_lossy"  # named: no rule
    selection._LOGGED_CHOICES.clear()
    with caplog.at_level(logging.INFO, logger="omni_kernels.attention"):
        A.attention(*short, allow_lossy=True)
        A.attention(*long, allow_lossy=True)
    messages = [r.getMessage() for r in caplog.records if "chose" in r.getMessage()]
    assert len(messages) == 2, messages  # same features, other lengths: logged again
    assert "'sdpa_math'" in messages[0] and "below its measured crossover 12" in messages[0]
    assert "'spy_lossy'" in messages[1]
    for bad in (0, "4096", 2.5, True):
        table.write_text(json.dumps({"archs": {"cpu": {
            "ranking": ["spy_lossy", "sdpa_math"], "lossy_min_seq": {"spy_lossy": bad}}}}))
        selection.reload_auto_table()
        with pytest.raises(ValueError, match="lossy_min_seq"):
            A.attention(*long, allow_lossy=True)
    # without permission for lossy backends the rule is not even read
    assert A.select_backend(*long)[0] == "sdpa_math"


def test_context_entered_after_a_compile_warns_once(caplog):
    """Compiled attention keeps the attention_backend() choice it was traced under; a later,
    different context says so (once), the traced one stays silent."""
    torch._dynamo.reset()
    selection._TRACED_CHOICES.clear()
    selection._WARNED_CHOICES.clear()
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    compiled = torch.compile(lambda q, k, v: A.attention(q, k, v), backend="eager", fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="omni_kernels.attention"):
        with A.attention_backend("sdpa_math"):  # nothing traced yet: silent
            out = compiled(q, k, v)
        with A.attention_backend("sdpa_math"):  # the traced choice: silent
            pass
        with A.attention_backend("auto", allow_lossy=True):
            assert torch.equal(compiled(q, k, v), out)  # still the traced backend
        with A.attention_backend("auto", allow_lossy=True):  # warned already
            pass
    messages = [r.getMessage() for r in caplog.records if "torch.compile traced" in r.getMessage()]
    assert len(messages) == 1, messages
    assert "attention_backend('auto', allow_lossy=True)" in messages[0]
    assert "under attention_backend('sdpa_math', allow_lossy=None)" in messages[0]
    torch._dynamo.reset()


def test_auto_ranking_follows_registration_and_the_table(tmp_path, monkeypatch):
    """auto's order is cached, and the cache follows (un)registration and table reloads."""
    before = A.auto_ranking("cpu")
    spec = A.BackendSpec(name="late_plugin", run=lambda *a, **k: None, description="a plug-in",
                         devices=("cpu",), dtypes=(torch.float32,), head_dims=(64,), layouts=("bhsd",))
    A.register_backend(spec)
    try:
        assert A.auto_ranking("cpu") == before + ["late_plugin"]
        table = tmp_path / "auto_table.json"
        table.write_text(json.dumps({"format": 1, "archs": {"cpu": {"ranking": ["late_plugin"]}}}))
        monkeypatch.setenv(A.ENV_AUTO_TABLE, str(table))
        selection.reload_auto_table()
        assert A.auto_ranking("cpu")[0] == "late_plugin"
        A.auto_ranking("cpu").clear()  # callers get a copy
        assert A.auto_ranking("cpu")[0] == "late_plugin"
    finally:
        A.unregister_backend("late_plugin")
        monkeypatch.delenv(A.ENV_AUTO_TABLE)
        selection.reload_auto_table()
    assert A.auto_ranking("cpu") == before


def test_auto_logs_choice_once(caplog):
    selection._LOGGED_CHOICES.clear()
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    with caplog.at_level(logging.INFO, logger="omni_kernels.attention"):
        A.attention(q, k, v)
        A.attention(q, k, v)
        A.attention(q, k, v, backend="auto")
    records = [r for r in caplog.records if "chose" in r.getMessage()]
    assert len(records) == 1
    assert "'sdpa_math'" in records[0].getMessage() and "head_dim=16" in records[0].getMessage()
    with caplog.at_level(logging.INFO, logger="omni_kernels.attention"):
        A.attention(q, k, v, causal=True)  # new features: logged again
        A.attention(*_qkv((1, 2, 8, 32), (1, 2, 8, 32)))  # new head_dim: logged again
        A.attention(q, k, v, causal=True)
    records = [r for r in caplog.records if "chose" in r.getMessage()]
    assert len(records) == 3
    assert "causal" in records[1].getMessage()


def test_argument_validation():
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    with pytest.raises(ValueError, match="layout"):
        A.attention(q, k, v, layout="sbhd")
    with pytest.raises(ValueError, match="head_dim"):
        A.attention(q, k, v[..., :8])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        A.attention(torch.randn(1, 3, 8, 16), k, v)
    with pytest.raises(ValueError, match="key_lengths"):
        A.attention(q, k, v, key_lengths=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="boolean key-padding mask"):
        A.attention(q, k, v, attn_mask=torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r"\[B, Skv\]"):
        A.attention(q, k, v, attn_mask=torch.ones(1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="not both"):
        A.attention(q, k, v, attn_mask=torch.ones(1, 8, dtype=torch.bool), key_lengths=torch.tensor([3]))


# --------------------------------------------------------------------------- SDPA on CPU


@pytest.mark.parametrize("backend", ["sdpa_math", "sdpa_flash"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "cross", "causal_cross"])
def test_sdpa_cpu_matches_reference(backend, layout, case):
    hkv = 1 if case == "gqa" else 4
    skv = 24 if "cross" in case else 40
    q, k, v = _qkv((2, 4, 40, 32), (2, hkv, skv, 32))
    causal = "causal" in case
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out, lse = A.attention(q, k, v, backend=backend, layout=layout, causal=causal, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, layout=layout, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel(out, ref) < 1e-5
    finite = torch.isfinite(ref_lse)
    assert lse.shape == ref_lse.shape and torch.allclose(lse[finite], ref_lse[finite], atol=1e-5)


def test_sdpa_math_key_lengths_and_masks():
    q, k, v = _qkv((2, 4, 16, 32), (2, 2, 24, 32))
    lengths = torch.tensor([5, 24])
    ref = attention_reference(q, k, v, key_lengths=lengths)
    assert _rel(A.attention(q, k, v, backend="sdpa_math", key_lengths=lengths), ref) < 1e-5
    # A prefix mask is the same thing.
    mask = torch.arange(24)[None, :] < lengths[:, None]
    assert _rel(A.attention(q, k, v, backend="sdpa_math", attn_mask=mask), ref) < 1e-5
    assert _rel(A.attention(q, k, v, backend="sdpa_math", attn_mask=mask[:, None, None, :]), ref) < 1e-5
    # A non-prefix mask: only mask-capable backends; compare with SDPA given the mask directly.
    holes = mask.clone()
    holes[1, 3] = False
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=holes[:, None, None, :])
    assert _rel(A.attention(q, k, v, attn_mask=holes), expected) < 1e-5
    with pytest.raises(ValueError, match="non-prefix key-padding mask"):
        A.attention(q, k, v, backend="sdpa_flash", attn_mask=holes)
    # An all-True mask is dropped: sdpa_flash (no mask support) takes it.
    full = torch.ones(2, 24, dtype=torch.bool)
    out = A.attention(q, k, v, backend="sdpa_flash", attn_mask=full)
    assert _rel(out, attention_reference(q, k, v)) < 1e-5
    # Causal + key lengths (folded into one SDPA mask).
    out = A.attention(q, k, v, backend="sdpa_math", key_lengths=lengths, causal=True)
    assert _rel(out, attention_reference(q, k, v, key_lengths=lengths, causal=True)) < 1e-5


# --------------------------------------------------------------------------- omni_triton (interpreter)


@needs_triton_flash
@pytest.mark.skipif(not ON_CPU_INTERPRETER, reason="CPU interpreter path")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_omni_triton_cpu_interpreter(layout):
    q, k, v = _qkv((2, 4, 40, 32), (2, 2, 24, 32))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    lengths = torch.tensor([7, 24], dtype=torch.int32)
    out, lse = A.attention(q, k, v, backend="omni_triton", layout=layout, causal=True,
                           key_lengths=lengths, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, layout=layout, causal=True, key_lengths=lengths,
                                       return_lse=True)
    assert out.shape == q.shape
    assert _rel(out, ref) < 1e-5
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-5)
    # A prefix key-padding mask becomes key_lengths, which omni_triton takes.
    mask = torch.arange(24)[None, :] < lengths[:, None]
    out = A.attention(q, k, v, backend="omni_triton", layout=layout, attn_mask=mask)
    assert _rel(out, attention_reference(q, k, v, layout=layout, key_lengths=lengths)) < 1e-5
    holes = mask.clone()
    holes[1, 2] = False
    with pytest.raises(ValueError, match="non-prefix key-padding mask"):
        A.attention(q, k, v, backend="omni_triton", layout=layout, attn_mask=holes)
    with pytest.raises(ValueError, match="cannot take dtype=bfloat16 on CPU"):
        A.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend="omni_triton", layout=layout)
    with pytest.raises(ValueError, match=r"cannot take head_dim=24: supports multiples of 16"):
        A.attention(q[..., :24], k[..., :24], v[..., :24], backend="omni_triton", layout=layout)


def test_omni_triton_unavailable_without_interpreter(monkeypatch):
    import omni_kernels._triton

    monkeypatch.setattr(omni_kernels._triton, "triton_interpreter_enabled", lambda: False)
    q, k, v = _qkv((1, 2, 16, 16), (1, 2, 16, 16))
    with pytest.raises(ValueError, match="omni_triton' is not available: Triton kernels need CUDA"):
        A.attention(q, k, v, backend="omni_triton")
    assert A.auto_ranking("cpu")[0] == "sdpa_math"


# --------------------------------------------------------------------------- patch_sdpa


def test_patch_sdpa_routes_falls_back_and_restores(caplog, spies):
    original = F.scaled_dot_product_attention
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    with caplog.at_level(logging.INFO, logger="omni_kernels.attention"):
        with A.patch_sdpa(backend="spy_a") as patch:
            assert F.scaled_dot_product_attention is patch
            assert torch.nn.functional.scaled_dot_product_attention(q, k, v)[0, 0, 0, 0].item() == 1
            key_pad = torch.ones(1, 1, 1, 8, dtype=torch.bool)
            assert F.scaled_dot_product_attention(q, k, v, attn_mask=key_pad)[0, 0, 0, 0].item() == 1
            expected = original(q, k, v, attn_mask=torch.zeros(8, 8))
            assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(8, 8)), expected)
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(8, 8))
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
            F.scaled_dot_product_attention(q[0], k[0], v[0])  # 3-D
            # Head counts that differ without enable_gqa: whatever SDPA does with them.
            assert torch.equal(F.scaled_dot_product_attention(q, k[:, :1], v[:, :1]),
                               original(q, k[:, :1], v[:, :1]))
    assert F.scaled_dot_product_attention is original
    assert patch.routed == {"spy_a": 2}
    assert patch.fallbacks["an additive (float) attn_mask"] == 2
    assert patch.fallbacks["dropout_p > 0"] == 1
    assert patch.fallbacks["inputs are not 4-D [B, H, S, D]"] == 1
    assert patch.fallbacks["different head counts without enable_gqa"] == 1
    assert spies["spy_a"].calls == 2
    messages = [r.getMessage() for r in caplog.records if "patch_sdpa" in r.getMessage()]
    assert sum("additive" in m for m in messages) == 1  # logged once per reason


def test_patch_sdpa_falls_back_when_backend_cannot_take_call(spies):
    q, k, v = _qkv((1, 2, 8, 256), (1, 2, 8, 256))
    with A.patch_sdpa(backend="spy_sage") as patch:
        out = F.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, torch._C._nn.scaled_dot_product_attention(q, k, v))
    assert patch.routed == {} and any("head_dim=256" in r for r in patch.fallbacks)


def test_patch_sdpa_nesting_and_exception_restore(spies):
    original = F.scaled_dot_product_attention
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    with A.patch_sdpa(backend="spy_a") as outer:
        with A.patch_sdpa(backend="spy_b") as inner:
            assert inner.original is outer
            assert F.scaled_dot_product_attention(q, k, v)[0, 0, 0, 0].item() == 2
        assert F.scaled_dot_product_attention is outer
        assert F.scaled_dot_product_attention(q, k, v)[0, 0, 0, 0].item() == 1
    assert F.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError, match="boom"):
        with A.patch_sdpa(backend="spy_a"):
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original
    with pytest.raises(ValueError, match="unknown attention backend"):
        with A.patch_sdpa(backend="nope"):
            pass
    assert F.scaled_dot_product_attention is original


def test_patch_sdpa_default_resolution_uses_context(spies):
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16))
    with A.patch_sdpa() as patch, A.attention_backend("spy_b"):
        assert F.scaled_dot_product_attention(q, k, v)[0, 0, 0, 0].item() == 2
    with A.patch_sdpa() as patch:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert patch.routed == {"sdpa_math": 1}  # auto on CPU, and sdpa_math does not recurse
    assert _rel(out, attention_reference(q, k, v, causal=True)) < 1e-5


# --------------------------------------------------------------------------- custom op, compile


@needs_triton_flash
@pytest.mark.skipif(not ON_CPU_INTERPRETER, reason="CPU interpreter path")
def test_custom_op_opcheck():
    q, k, v = _qkv((1, 2, 20, 16), (1, 1, 12, 16))
    lengths = torch.tensor([5], dtype=torch.int32)
    op = torch.ops.omni_kernels.flash_attention_fwd.default
    torch.library.opcheck(op, (q, k, v, "bhsd", True, 0.25, lengths))
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    torch.library.opcheck(op, (qs, ks, vs, "bshd", False, 0.25, None))


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 40, 3, 64, dtype=torch.float16)
        k = torch.empty(2, 24, 1, 64, dtype=torch.float16)
        out, lse = torch.ops.omni_kernels.flash_attention_fwd(q, k, k, "bshd", False, 0.125, None)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (2, 3, 40) and lse.dtype == torch.float32 and lse.is_contiguous()
        qb = q.transpose(1, 2)
        out, lse = torch.ops.omni_kernels.flash_attention_fwd(qb, k.transpose(1, 2), k.transpose(1, 2),
                                                              "bhsd", True, 0.125, None)
        assert out.shape == (2, 3, 40, 64) and out.is_contiguous() and lse.shape == (2, 3, 40)


class _AttnModule(torch.nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.backend = backend

    def forward(self, x, key_lengths=None):
        b, s, _ = x.shape
        qkv = self.proj(x).unflatten(-1, (2, 16))  # [B, S, H, D]
        out = A.attention(qkv, qkv, qkv, backend=self.backend, layout="bshd", key_lengths=key_lengths)
        return out.flatten(2) * 2


@needs_triton_flash
@pytest.mark.skipif(not ON_CPU_INTERPRETER, reason="CPU interpreter path")
def test_torch_compile_fullgraph_omni_triton():
    torch._dynamo.reset()
    module = _AttnModule("omni_triton").eval()
    x = torch.randn(1, 24, 32)
    lengths = torch.tensor([17], dtype=torch.int32)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected = module(x, lengths)
        got = compiled(x, lengths)
    assert _rel(got, expected) < 1e-6
    # auto and the context manager trace too (choice made at trace time, guarded).
    torch._dynamo.reset()
    compiled = torch.compile(_AttnModule(None).eval(), fullgraph=True, backend="aot_eager")
    with torch.no_grad(), A.attention_backend("omni_triton"):
        compiled(x)
    with torch.no_grad():
        compiled(x)


# --------------------------------------------------------------------------- GPU


GPU_CASES = ["bhsd", "bshd", "causal", "gqa", "cross", "key_lengths", "lse"]


def _gpu_case(spec, case):
    """(kwargs for attention, q/k/v shapes) or None when the spec does not declare the feature."""
    b, h, s, d = 2, 8, 1024, 128
    shapes = ((b, h, s, d), (b, h, s, d))
    kwargs = {"layout": "bhsd"}
    if case == "bshd":
        kwargs["layout"] = "bshd"
    elif case == "causal":
        if not spec.causal:
            return None
        kwargs["causal"] = True
    elif case == "gqa":
        if not spec.gqa:
            return None
        shapes = ((b, h, s, d), (b, 2, s, d))
    elif case == "cross":
        shapes = ((b, h, s, d), (b, h, 333, d))
    elif case == "key_lengths":
        if not spec.key_lengths:
            return None
        kwargs["key_lengths"] = torch.tensor([300, 1024], dtype=torch.int32, device="cuda")
    elif case == "lse":
        if not spec.lse:
            return None
        kwargs["return_lse"] = True
    return kwargs, shapes


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("backend", sorted(EXPECTED - {"sdpa_math"}))
def test_gpu_backend_features_vs_reference(backend, case):
    spec = A.get_backend(backend)
    reason = spec.unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    plan = _gpu_case(spec, case)
    if plan is None:
        pytest.skip(f"{backend} does not declare {case}")
    kwargs, (shape_q, shape_kv) = plan
    q, k, v = _qkv(shape_q, shape_kv, dtype=torch.bfloat16, device="cuda")
    if kwargs["layout"] == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    chosen, why = A.select_backend(q, k, v, backend=backend, **{k_: v_ for k_, v_ in kwargs.items()
                                                                 if k_ != "return_lse"},
                                   return_lse=kwargs.get("return_lse", False))
    if chosen is None:
        pytest.skip(why)
    result = A.attention(q, k, v, backend=backend, **kwargs)
    out, lse = result if kwargs.get("return_lse") else (result, None)
    ref, ref_lse = attention_reference(
        q.float(), k.float(), v.float(), layout=kwargs["layout"], causal=kwargs.get("causal", False),
        key_lengths=kwargs.get("key_lengths"), return_lse=True,
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    limit = 5e-2 if spec.lossy else 1e-2
    assert _rel(out.float(), ref) < limit
    if lse is not None:
        assert lse.shape == ref_lse.shape
        assert torch.allclose(lse, ref_lse, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", sorted(EXPECTED - {"sdpa_math"}))
def test_gpu_backend_real_shape(backend):
    """Flux 1024x1024 attention (1 x 24 x 4608 x 128, bf16) vs the float32 reference."""
    spec = A.get_backend(backend)
    reason = spec.unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    q, k, v = _qkv((1, 24, 4608, 128), (1, 24, 4608, 128), dtype=torch.bfloat16, device="cuda")
    chosen, why = A.select_backend(q, k, v, backend=backend)
    if chosen is None:
        pytest.skip(why)
    out = A.attention(q, k, v, backend=backend)
    ref = A.attention(q.float(), k.float(), v.float(), backend="sdpa_efficient")
    assert _rel(out.float(), ref) < (5e-2 if spec.lossy else 1e-2)


@pytest.mark.gpu
def test_gpu_auto_prefers_table_order():
    q, k, v = _qkv((1, 24, 1024, 128), (1, 24, 1024, 128), dtype=torch.bfloat16, device="cuda")
    chosen, _ = A.select_backend(q, k, v)
    arch = _arch_of(q.device)[0]
    first_ok = next(n for n in A.auto_ranking(arch) if A.select_backend(q, k, v, backend=n)[0] == n)
    assert chosen == first_ok
    assert not A.get_backend(chosen).lossy
