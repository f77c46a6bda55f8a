# ruff: noqa  (a one-off experiment script, removed again by the commit after the one that adds it)
"""Experiment: omni_kernels::fp8_gemm_cutlass (CUTLASS Hopper FP8 GEMM, stream-K and data-parallel
schedules, clusters 1x1/2x1) against omni_kernels::fp8_gemm_cublaslt on the same operands, then
quantize + GEMM against bf16 at Flux 12288->3072. Run on the GPU after building with CUTLASS:
`python3 bench/fp8_gemm_cutlass_scan.py`."""
import torch
import triton
from omni_kernels.quant import quantize_per_token
torch.manual_seed(0)
dev = "cuda"
ops = torch.ops.omni_kernels
has = hasattr(ops, "fp8_gemm_cutlass")
print("cutlass op:", has)
SCHED = ["streamk-1x1", "streamk-2x1", "data_parallel-1x1", "data_parallel-2x1", "heuristic-1x1", "heuristic-2x1"]
shapes = [(4608, 3072, 12288), (4608, 3072, 3072), (4608, 12288, 3072), (4608, 3072, 15360),
          (75600, 5120, 5120), (75600, 13824, 5120), (75600, 5120, 13824), (333, 3072, 3072), (4224, 3072, 12288)]
def bench(f, rep):
    return triton.testing.do_bench(f, warmup=20, rep=rep)
out_rows = []
for (M, N, K) in shapes:
    rep = 60 if M > 10000 else 120
    a = (torch.randn(M, K, device=dev) * 2).to(torch.float8_e4m3fn)
    w = (torch.randn(N, K, device=dev) * 2).to(torch.float8_e4m3fn)
    sa = torch.rand(M, 1, device=dev) + 0.5
    sw = torch.rand(N, device=dev) + 0.5
    bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
    ref = torch.addmm(bias.float(), a.float() * sa, (w.float() * sw[:, None]).t())
    def err(o): return ((o.float() - ref).norm() / ref.norm()).item()
    fns = {"cublaslt": lambda: ops.fp8_gemm_cublaslt(a, sa, w, sw, bias, torch.bfloat16, False, True)}
    if has:
        for s in SCHED:
            fns["cutlass-" + s] = (lambda s=s: ops.fp8_gemm_cutlass(a, sa, w, sw, bias, torch.bfloat16, s))
    res = {}
    for name, f in fns.items():
        try:
            o = f(); torch.cuda.synchronize()
            res[name] = [err(o), []]
        except Exception as e:
            res[name] = [None, str(e)[:120]]
    del ref
    for rnd in range(2):
        for name, f in fns.items():
            if res[name][0] is None: continue
            res[name][1].append(bench(f, rep))
    base = min(res["cublaslt"][1])
    fl = 2 * M * N * K
    for name, (e, t) in res.items():
        if e is None:
            print(f"{M}x{N}x{K} {name}: FAILED {t}"); continue
        tm = min(t)
        out_rows.append((f"{M}x{N}x{K}", name, tm * 1e3, fl / tm / 1e9, base / tm, e))
    del a, w
    torch.cuda.empty_cache()
print("| shape | gemm | us | TFLOP/s | vs cublaslt | rel err |")
for r in out_rows:
    print("| %s | %s | %.1f | %.0f | %.3f | %.2e |" % r)
# end to end at the Flux down projection: bf16 linear vs quantize + GEMM
M, N, K = 4608, 3072, 12288
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
wb = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 100
b = torch.randn(N, device=dev, dtype=torch.bfloat16)
wq = wb.float().abs().amax(1) / 448
w8 = (wb.float() / wq[:, None]).to(torch.float8_e4m3fn)
def lin():
    return torch.nn.functional.linear(x, wb, b)
def q8(g):
    def f():
        q, s = quantize_per_token(x, "fp8")
        return g(q, s)
    return f
cands = {"bf16": lin, "quant only": lambda: quantize_per_token(x, "fp8"),
         "q+cublaslt": q8(lambda q, s: ops.fp8_gemm_cublaslt(q, s, w8, wq, b, torch.bfloat16, False, True))}
if has:
    for s in ["streamk-1x1", "streamk-2x1", "heuristic-1x1"]:
        cands["q+cutlass-" + s] = q8(lambda q, sc, s=s: ops.fp8_gemm_cutlass(q, sc, w8, wq, b, torch.bfloat16, s))
for f in cands.values(): f()
times = {k: [] for k in cands}
for rnd in range(3):
    for k, f in cands.items():
        times[k].append(bench(f, 150))
print("| flux 12288->3072 | median us | vs bf16 |")
tb = sorted(times["bf16"])[1]
for k, t in times.items():
    tm = sorted(t)[1]
    print("| %s | %.1f | %.3f |" % (k, tm * 1e3, tb / tm))
