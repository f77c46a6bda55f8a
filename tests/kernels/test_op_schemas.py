"""Every ``omni_kernels::`` op's schema, as registered from Python and (when built) from C++.

Inductor lowers an op it cannot fuse to a fallback built as ``FallbackKernel.create(kernel,
*args, **kwargs)``; an op argument named ``kernel`` then collides with that parameter
("got multiple values for argument 'kernel'") and ``torch.compile`` fails at the first call
(seen on the H200 with ``sage_attention_fwd``'s former ``kernel`` argument)."""

from __future__ import annotations

import importlib

import torch

# The modules that register ops (each registers on import).
OP_MODULES = (
    "omni_kernels.attention",
    "omni_kernels.attention.quantized.ops",
    "omni_kernels.quant",
    "omni_kernels.quant.gemm_ops",
)
#: argument names Inductor's fallback lowering already uses as its own parameters
RESERVED_BY_INDUCTOR = {"kernel"}


def _omni_schemas() -> dict[str, torch._C.FunctionSchema]:
    for name in OP_MODULES:
        importlib.import_module(name)
    schemas = {}
    for op_name in torch._C._dispatch_get_all_op_names():
        if op_name.startswith("omni_kernels::"):
            schemas[op_name] = torch._C._get_schema(op_name, "")
    return schemas


def test_python_ops_are_registered():
    names = set(_omni_schemas())
    assert "omni_kernels::sage_attention_fwd" in names, sorted(names)


def test_no_op_argument_collides_with_inductor_fallback():
    bad = {name: [a.name for a in schema.arguments if a.name in RESERVED_BY_INDUCTOR]
           for name, schema in _omni_schemas().items()}
    bad = {name: args for name, args in bad.items() if args}
    assert not bad, f"rename these op arguments (Inductor reserves them): {bad}"


def test_sage_attention_fwd_names_its_implementation_argument():
    schema = _omni_schemas()["omni_kernels::sage_attention_fwd"]
    names = [a.name for a in schema.arguments]
    assert names[-1] == "implementation" and "kernel" not in names
