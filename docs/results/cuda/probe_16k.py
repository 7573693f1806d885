import torch, torch.nn.functional as F
import linear_mha.functional as LF
from linear_mha.functional import backend
from torch.profiler import profile, ProfilerActivity
dev = "cuda"
def bench(fn, reps=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / reps
def split(q, k, v, C=64):
    B, H, N, d = q.shape
    qf, kf, vf = q.float(), k.float(), v.float()
    pq, pk = F.elu(qf) + 1, F.elu(kf) + 1
    kv = torch.matmul(pk.view(B, H, C, -1, d).transpose(-2, -1), vf.view(B, H, C, -1, d)).sum(2)
    ks = pk.view(B, H, C, -1, d).sum(3).sum(2).unsqueeze(-1)
    return (torch.matmul(pq, kv) / torch.matmul(pq, ks)).to(q.dtype)
print("B H dtype | full  split  causal  causal_nofla  sdpa  sdpa_causal (ms, back-to-back)")
for B, H in [(1, 16), (8, 16)]:
    for dtype in [torch.bfloat16, torch.float32]:
        q, k, v = (torch.randn(B, H, 16384, 64, device=dev, dtype=dtype) for _ in range(3))
        with torch.inference_mode():
            ref = LF.kernel(q, k, v, "elu")
            err = ((split(q, k, v).float() - ref.float()).norm() / ref.float().norm()).item()
            t = [bench(lambda: LF.kernel(q, k, v, "elu")), bench(lambda: split(q, k, v)),
                 bench(lambda: LF.kernel(q, k, v, "elu", causal=True))]
            with backend.override(fla=False):
                t.append(bench(lambda: LF.kernel(q, k, v, "elu", causal=True)))
            t += [bench(lambda: F.scaled_dot_product_attention(q, k, v)),
                  bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))]
        print(B, H, dtype, " ".join(f"{x:.3f}" for x in t), f"split err {err:.1e}", flush=True)
q, k, v = (torch.randn(1, 16, 16384, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    with torch.inference_mode():
        for _ in range(3): LF.kernel(q, k, v, "elu", causal=causal)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5): LF.kernel(q, k, v, "elu", causal=causal)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=50))
