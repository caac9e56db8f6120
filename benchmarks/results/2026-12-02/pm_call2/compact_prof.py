"""Where does the counted-rows first pass lose time? Llama-3 shape, 30 % ignored, zero-logits
backward, both modes under torch.profiler (after warm-up); kernels grouped by name, and the
matmul shapes (from record_shapes) with their total time."""
import json, math, collections
import torch
from torch.profiler import profile, ProfilerActivity
from fused_ce_patch import fused_linear_cross_entropy as f
from fused_ce_patch.backends.triton import zero_logits_inplace as zi
dev = "cuda"
n, h, v = 8192, 4096, 128256
g = torch.Generator(device=dev).manual_seed(0)
hid = torch.randn(n, h, device=dev, generator=g).bfloat16().requires_grad_()
w = (torch.randn(v, h, device=dev, generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
y = torch.randint(0, v, (n,), device=dev, generator=g); y[torch.rand(n, device=dev, generator=g) < 0.3] = -100
for mode in (False, True):
    zi.COMPACT = mode
    zi.COMPACT_MIN_SAVING, zi.COMPACT_MAX_UNDER = (0.0, 1.0)
    def step():
        hid.grad = None; w.grad = None
        loss = f(hid, w, y, logits_budget=0, backend="triton"); loss.backward()
    for _ in range(3): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step(); torch.cuda.synchronize()
    ka = prof.key_averages(group_by_input_shape=True)
    rows = []
    for e in ka:
        t = e.self_device_time_total / 1e3
        if e.key.startswith("aten::") and t > 0.05 or e.key.endswith("kernel") and t > 0.05:
            rows.append((round(t, 2), e.count, e.key[:40], str(e.input_shapes)[:150]))
    print("=== compact" if mode else "=== all rows")
    tot = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    print("device total ms (self sum)", round(tot, 2))
    for r in sorted(rows, reverse=True)[:40]:
        print(r)
    kn = collections.Counter(); kc = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kn[e.name[:60]] += e.time_range.elapsed_us() / 1e3; kc[e.name[:60]] += 1
    for k, t in kn.most_common(15):
        print(f"  {t:8.2f} ms  x{kc[k]:4d}  {k}")
    prof.export_chrome_trace(f"{__import__('os').environ['OUT']}/compact_{int(mode)}.json")
