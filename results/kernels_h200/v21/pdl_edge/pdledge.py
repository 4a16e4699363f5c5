"""Kernel timeline of GEMV(gateup) -> gated formed rotation -> GEMV(down), PDL on/off for the rotation,
under CUDA-graph replay, from torch.profiler's kernel records (results/kernels_h200/v21/ §3).

    python pdledge.py OUT.json [ROWS]   (a CUDA GPU; qpalette importable)
"""
import json, sys
import torch
from torch.profiler import profile, ProfilerActivity
from qpalette.quant.incoherence import pack_signs, random_signs
from qpalette.quant.palette import get_quantizer
from qpalette.runtime import lanes, ops, kernel_build
from qpalette.quant.hadamard import decompose

name, m = "tcq-2.0", int(sys.argv[2]) if len(sys.argv) > 2 else 8
q = get_quantizer(name)
gu_t = lanes.pack(name, q.random_tensors(28672, 4096, None, "cuda"))
dn_t = lanes.pack(name, q.random_tensors(4096, 14336, None, "cuda"))
signs = pack_signs(random_signs(14336, seed=0)).cuda()
x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
dev = x.device
ext = kernel_build.extension(dev)
k, p2 = decompose(14336)
hk = ops._hadamard_factor(k, dev)

def chain(pdl):
    gu = ops.quantized_matmul(x, name, gu_t, (28672, 4096))
    xr = ext.hadamard_formed(gu, signs, hk, k, p2, ops._stream(dev), ops._num_sms(dev), pdl, True, None, 0.0, None, None)
    return ops.quantized_matmul(xr, name, dn_t, (4096, 14336))

res = {}
for pdl in (True, False):
    for _ in range(3): chain(pdl)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        chain(pdl)
        with torch.cuda.graph(g, stream=s):
            for _ in range(10): chain(pdl)
    torch.cuda.synchronize()
    for _ in range(20): g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): g.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if len(ev) < 90:  # no kernel records from graph replays: eager chains (the GPU queue runs ahead)
        print(f"pdl={pdl}: {len(ev)} records from graphs; eager instead")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50): chain(pdl)
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name]
    ks = sorted([(e.time_range.start, e.time_range.end, e.name[:40]) for e in ev])
    t0 = ks[0][0]
    rows = [(round(a - t0, 2), round(b - t0, 2), n) for a, b, n in ks]
    res[f"pdl{int(pdl)}"] = rows
    # per-chain: start of first gemv to end of down gemv, over chains 10..39 (triples)
    trip = [rows[i:i + 3] for i in range(0, len(rows) - 2, 3)]
    tot = [(t[2][1] - t[0][0]) for t in trip[10:40]]
    print(f"pdl={pdl}: {len(rows)} kernels; chain span median {sorted(tot)[len(tot)//2]:.2f} us")
    for t in trip[20:23]:
        print("  ", [(a, b, n) for a, b, n in t])
    print("  per-step period", round((rows[-1][1] - rows[0][0]) / len(trip), 2), "us")
json.dump(res, open(sys.argv[1], "w"), indent=0)
