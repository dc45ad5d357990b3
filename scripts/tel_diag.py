"""Where the time of nn.TransformerEncoderLayer(512, 16) eval at 128 x 128 tokens goes, routing off and on
(bench_modules measured routing on 0.85x although both modes run the same fused op and kernels).

Per variant: host issue time per call (a block of calls, no synchronisation inside), GPU time per call
(CUDA events around the block), the variants alternated block by block over ROUNDS rounds (medians);
then the top host ops of one call under torch.profiler, and any synchronisation the call makes.
Usage: python scripts/tel_diag.py
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from torch import nn

import fa_backend
from fa_backend.integrations import modules as _modules

DT = torch.bfloat16
ROUNDS, CALLS = 15, 20


def _variants(layer: nn.TransformerEncoderLayer, x: torch.Tensor) -> dict:
    fa_backend.enable()
    args = _modules._encoder_layer_fused_args(layer, x)
    fa_backend.disable()
    assert args is not None
    return {
        "off": (False, lambda: layer(x)),
        "on": (True, lambda: layer(x)),
        "fused_direct": (False, lambda: torch._transformer_encoder_layer_fwd(*args)),
        "fused_direct_router_on": (True, lambda: torch._transformer_encoder_layer_fwd(*args)),
    }


def _timed(variants: dict) -> None:
    host = {k: [] for k in variants}
    gpu = {k: [] for k in variants}
    for _ in range(ROUNDS):
        for name, (on, fn) in variants.items():
            (fa_backend.enable if on else fa_backend.disable)()
            fn()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            for _ in range(CALLS):
                fn()
            b.record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host[name].append((t1 - t0) / CALLS * 1e6)
            gpu[name].append(a.elapsed_time(b) / CALLS * 1e3)
    fa_backend.disable()
    for name in variants:
        print(f"  {name:<24} host issue {statistics.median(host[name]):8.1f} µs/call   "
              f"GPU {statistics.median(gpu[name]):8.1f} µs/call  (medians of {ROUNDS} blocks of {CALLS})")


def _profile(variants: dict) -> None:
    for name, (on, fn) in variants.items():
        (fa_backend.enable if on else fa_backend.disable)()
        fn()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            fn()
            torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message)[:100] for w in caught if "synchron" in str(w.message).lower()]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        fa_backend.disable()
        print(f"=== {name}: {len(syncs)} synchronising calls {syncs[:3]}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def main() -> None:
    torch.manual_seed(0)
    for embed, heads, b, s in ((512, 16, 128, 128), (64, 2, 1, 16)):
        layer = nn.TransformerEncoderLayer(embed, heads, 4 * embed, dropout=0.0, batch_first=True, device="cuda",
                                           dtype=DT).eval()
        x = torch.randn(b, s, embed, device="cuda", dtype=DT)
        print(f"##### TransformerEncoderLayer({embed}, {heads}) eval, x {tuple(x.shape)}")
        with torch.no_grad():
            variants = _variants(layer, x)
            _timed(variants)
            _profile(variants)


if __name__ == "__main__":
    main()
