"""The CUDA probe of docs/speed.md (run by docs/gpu/check.sh from the repository root). Modes:
compile METHOD MODE   20 training steps of METHOD's deep-narrow stack (E=5), the forward under torch.compile(mode)
capture METHOD E      the eager step against the same step captured whole in a CUDA graph (fwd + bwd + AdamW)
"""

import json
import sys
import time

import torch

from qlbench import adapters, engine
from qlbench.backbones import build_backbone


def stack(method, E, device="cuda"):
    members = [("dropwave", s) for s in range(E)]
    bb = build_backbone("deep-narrow", members, device="cpu", dtype=torch.float32, init="kaiming")
    pre = engine.Pretrained("deep-narrow", members, bb.state_dict(), [0.0] * E, [0.0] * E)
    cfg = adapters.get(method).make_config()
    model, data = engine.build_model(pre, method, cfg, device=torch.device(device), dtype=torch.float32)
    return model, data, cfg


def batch(data, i=0, b=64):
    return data.x_train[:, i : i + b].contiguous(), data.y_train[:, i : i + b].contiguous()


def compile_mode(method, mode, n=20):
    model, data, cfg = stack(method, 5)
    opt = adapters.get(method).optimizer(model, cfg, 5e-4, 0.01)
    torch._dynamo.reset()
    fwd = torch.compile(model, mode=None if mode == "default" else mode, dynamic=False)
    xb, yb = batch(data)
    t0 = time.perf_counter()
    for k in range(n):
        loss = (fwd(xb, None) - yb).pow(2).mean(1)
        loss.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k == 2:
            torch.cuda.synchronize()
            t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(
        json.dumps(
            dict(
                probe="compile",
                method=method,
                mode=mode,
                warmup_s=round(t1 - t0, 1),
                ms_per_step=round((time.perf_counter() - t1) / (n - 3) * 1e3, 3),
                loss=loss.sum().item(),
            )
        )
    )


def count_kernels(fn, reps=3):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    kern = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    return kern / reps


def timed(fn, reps=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def capture(method, E):
    model, data, cfg = stack(method, E)
    params = [p for p in model.parameters() if p.requires_grad]
    xb, yb = batch(data)
    opt_e = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.01, fused=True)

    def eager():
        loss = (model(xb, None) - yb).pow(2).mean(1)
        loss.sum().backward()
        opt_e.step()
        opt_e.zero_grad(set_to_none=False)
        return loss

    eager_ms = timed(eager)
    eager_k = count_kernels(eager)
    # captured: static input buffers, capturable fused AdamW, grads kept allocated
    opt = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.01, fused=True, capturable=True)
    sx, sy = xb.clone(), yb.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            loss = (model(sx, None) - sy).pow(2).mean(1)
            loss.sum().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(g):
        sloss = (model(sx, None) - sy).pow(2).mean(1)
        sloss.sum().backward()
        opt.step()

    def replay():
        g.replay()

    cap_ms = timed(replay)
    cap_k = count_kernels(replay)
    print(
        json.dumps(
            dict(
                probe="capture",
                method=method,
                E=E,
                eager_ms=round(eager_ms, 3),
                eager_kernels=eager_k,
                captured_ms=round(cap_ms, 3),
                captured_kernels=cap_k,
                speedup=round(eager_ms / cap_ms, 1),
            )
        )
    )


if __name__ == "__main__":
    torch.manual_seed(0)
    kind = sys.argv[1]
    if kind == "compile":
        compile_mode(sys.argv[2], sys.argv[3])
    else:
        capture(sys.argv[2], int(sys.argv[3]))
