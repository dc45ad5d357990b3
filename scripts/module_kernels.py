"""Which CUDA kernels an nn module runs with routing off and on, and their GPU time (a diagnostic for
scripts/bench_modules.py's rows where routing on measures slower although the dispatcher picked
PyTorch's kernel).

For each case: the kernels (name, count, total µs) of one call under torch.profiler in both modes,
then the wall time per call (synchronized loops), and the GPU time per call between CUDA events, the
modes alternated call by call over many calls (median).
Usage: python scripts/module_kernels.py
"""

from __future__ import annotations

import collections
import statistics
import time

import torch
from torch import nn

import fa_backend

DT = torch.bfloat16


def _kernels(fn) -> dict[str, tuple[int, float]]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:90]][0] += 1
            out[e.name[:90]][1] += e.device_time_total
    return dict(out)


def _switch(on: bool):
    (fa_backend.enable if on else fa_backend.disable)()


def _alternating(fn, calls: int) -> dict[bool, tuple[float, float]]:
    """{on: (median GPU µs between events, median wall µs)}: the modes alternated call by call."""
    gpu, wall = {False: [], True: []}, {False: [], True: []}
    for i in range(2 * calls):
        on = bool(i % 2)
        _switch(on)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        wall[on].append((time.perf_counter() - t0) * 1e6)
        gpu[on].append(start.elapsed_time(end) * 1e3)
    _switch(False)
    return {on: (statistics.median(gpu[on]), statistics.median(wall[on])) for on in (False, True)}


def main() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(2048, 16, batch_first=True, device="cuda", dtype=DT).eval()
    x = torch.randn(8, 2048, 2048, device="cuda", dtype=DT)
    layer = nn.TransformerEncoderLayer(64, 1, 128, dropout=0.0, batch_first=True, device="cuda", dtype=DT)
    xs = torch.randn(1, 16, 64, device="cuda", dtype=DT, requires_grad=True)
    enc = nn.TransformerEncoderLayer(512, 16, 2048, dropout=0.0, batch_first=True, device="cuda", dtype=DT).eval()
    xe = torch.randn(128, 128, 512, device="cuda", dtype=DT)
    enc_tiny = nn.TransformerEncoderLayer(64, 2, 128, dropout=0.0, batch_first=True, device="cuda", dtype=DT).eval()
    xt = torch.randn(1, 16, 64, device="cuda", dtype=DT)
    cases = [("mha_eval E=2048 h=16 s=2048 b=8 (no_grad)", lambda: mha(x, x, x, need_weights=False), 200),
             ("encoder_layer_train_tiny E=64 h=1 s=16", lambda: layer(xs).sum().backward(), 400),
             # bench_modules measured these slower with routing on in every run of 2026-11-30 (0.85-0.86x and
             # 0.86-0.93x) although both modes should run the same fused op
             ("encoder_layer_eval E=512 h=16 s=128 b=128 (no_grad)", lambda: enc(xe), 300),
             ("encoder_layer_eval_tiny E=64 h=2 s=16 (no_grad)", lambda: enc_tiny(xt), 1000)]
    for name, fn, calls in cases:
        print(f"=== {name}")
        with torch.set_grad_enabled("no_grad" not in name):
            for on in (False, True):
                _switch(on)
                ks = _kernels(fn)
                _switch(False)
                print(f"  routing {'on ' if on else 'off'}: {sum(c for c, _ in ks.values())} kernels, "
                      f"{sum(t for _, t in ks.values()):.1f} µs")
                for k, (c, t) in sorted(ks.items(), key=lambda kv: -kv[1][1])[:12]:
                    print(f"    {c:3d} {t:9.1f}  {k}")
            res = _alternating(fn, calls)
        for on in (False, True):
            print(f"  routing {'on ' if on else 'off'}: GPU {res[on][0]:9.1f} µs (events, median), "
                  f"wall {res[on][1]:9.1f} µs per call (median of {calls})")


if __name__ == "__main__":
    main()
