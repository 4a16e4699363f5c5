"""Per-layer decode attention timings at Llama-3.1-8B head shapes, compiled reduce-overhead."""
import sys, time, torch, warnings
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from qpalette.generation.attention import packed_gqa_attention

class M(torch.nn.Module):
    num_key_value_groups = 4; is_causal = True
mod = M()

def packed_backend(backend):
    def f(q, k, v, mask):
        b, h, _, d = q.shape
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q.reshape(b, 8, 4, d), k, v, attn_mask=mask, scale=d ** -0.5)
        return o.reshape(b, 1, h, d)
    return f

def packed_math(q, k, v, mask):
    b, h, _, d = q.shape
    qp = q.reshape(b, 8, 4, d)
    s = (qp.float() @ k.float().transpose(-1, -2)) * d ** -0.5 + mask.float()
    p = s.softmax(-1)
    return (p @ v.float()).to(q.dtype).reshape(b, 1, h, d)

V = {
 "sdpa(transformers)": lambda q, k, v, m: sdpa_attention_forward(mod, q, k, v, m, scaling=q.shape[-1] ** -0.5)[0],
 "packed(default)": lambda q, k, v, m: packed_gqa_attention(mod, q, k, v, m, scaling=q.shape[-1] ** -0.5)[0],
 "packed(cudnn)": packed_backend(SDPBackend.CUDNN_ATTENTION),
 "packed(efficient)": packed_backend(SDPBackend.EFFICIENT_ATTENTION),
 "packed(math-matmul)": packed_math,
}
for b in (1, 8):
    for L in (80, 1024, 4096):
        q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.half)
        k = torch.randn(b, 8, L, 128, device="cuda", dtype=torch.half)
        v = torch.randn_like(k)
        mb = torch.zeros(b, 1, 1, L, dtype=torch.bool, device="cuda"); mb[..., : L * 3 // 4] = True
        mask = torch.zeros(b, 1, 1, L, dtype=torch.half, device="cuda").masked_fill(~mb, -65504.0)
        ref = None
        for name, fn in V.items():
            for mk, mm in (("bool", mb), ("add", mask)):
                torch._dynamo.reset()
                from torch._dynamo.utils import counters
                counters.clear()
                try:
                    f = torch.compile(fn, mode="reduce-overhead")
                    for _ in range(3): out = f(q, k, v, mm).clone()
                    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
                    torch._dynamo.reset()
                    g = torch.compile(fn)
                    for _ in range(3): g(q, k, v, mm)
                    torch.cuda.synchronize()
                    from torch.profiler import profile, ProfilerActivity
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(20): g(q, k, v, mm)
                        torch.cuda.synchronize()
                    ev = [x for x in prof.events() if x.device_type == torch.autograd.DeviceType.CUDA]
                    us = sum(x.time_range.elapsed_us() for x in ev) / 20
                    names = sorted({x.name[:60] for x in ev})
                    if ref is None: ref = out.float()
                    err = (out.float() - ref).abs().max().item()
                    print(f"b{b} L{L:5d} {name:22s} {mk:4s} {us:7.1f} us GPU, {len(ev)/20:.0f} kernels  err {err:.1e}  cudagraph_skips {skips}  {names}", flush=True)
                except Exception as ex:
                    print(f"b{b} L{L:5d} {name:22s} {mk:4s} FAILED {str(ex).splitlines()[0][:150]}", flush=True)
