"""GPU timing of nn.MultiheadAttention / nn.TransformerEncoderLayer with routing off and on.

Without fa_backend these modules take PyTorch's fused C++ fast path in eval mode; with routing on
they run through `fa_backend.integrations.mha`. Three modes per case, measured in one run:
  off        routing disabled (PyTorch's fast path in eval, its Python path in training)
  on         routing enabled (the dispatcher's choice: our kernel where eligible)
  on_torch   routing enabled but restricted to PyTorch's fused SDPA: isolates the cost of the
             routed module code from the kernel difference
GPU-bound cases: CUDA events around blocks of calls, the three modes alternated block by block over
--rounds rounds, the median per mode. Host-bound (tiny) cases: wall time per call, interleaved likewise
(the order of the modes rotated round by round), the minimum per mode. The printed ratios are paired:
the median over rounds of off / mode within each round.
Usage: python scripts/bench_modules.py [--json FILE] [--rounds R] [--host-only]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import fa_backend
from _records import write_records  # scripts/_records.py

DT = torch.bfloat16
TOKENS = 16384


ROUNDS = 10


def _warm_gpu(seconds: float = 2.0) -> None:
    """Bring the GPU out of its idle clocks before the first case is timed."""
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


_MODES = ("off", "on", "on_torch")


def _switch(mode: str):
    """Routing as `mode` says; returns the context to run the calls in."""
    import contextlib

    fa_backend.disable()
    if mode == "off":
        return contextlib.nullcontext()
    fa_backend.enable()
    return fa_backend.sdpa_backends(["torch"]) if mode == "on_torch" else contextlib.nullcontext()


def _summary(samples: dict[str, list[float]], pick) -> dict:
    """{mode: pick(rounds)}, the paired ratios off / mode (the median over rounds of each round's ratio: a
    clock step between rounds moves both modes of a round alike, not one mode's pick), and, for the JSON,
    every mode's rounds (how much they spread)."""
    out = {mode: pick(v) for mode, v in samples.items()}
    for mode in ("on", "on_torch"):
        out[f"ratio_{mode}"] = statistics.median(a / b for a, b in zip(samples["off"], samples[mode]))
    out["rounds"] = {mode: [round(x, 4) for x in v] for mode, v in samples.items()}
    return out


def _modes(fn):
    """{mode: ms per call}: GPU time between CUDA events around blocks of calls, the three modes
    alternated block by block over ROUNDS rounds (clock and thermal drifts hit all alike), the median
    per mode. No synchronisation inside a round, so the host stays ahead of the GPU as in a training
    loop. (triton's do_bench, used before, measured routing on 5-10 % slower on calls whose kernels
    are identical in both modes, which an alternating A/B of the same calls did not reproduce.)"""
    for mode in _MODES:  # warm-up; size the blocks to ~5 ms
        with _switch(mode):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(1, min(50, int(5.0 / max(start.elapsed_time(end), 1e-3))))
    samples = {mode: [] for mode in _MODES}
    for _ in range(ROUNDS):
        events = []
        for mode in _MODES:
            with _switch(mode):
                fn()
                pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                pair[0].record()
                for _ in range(calls):
                    fn()
                pair[1].record()
                events.append((mode, pair))
        torch.cuda.synchronize()
        for mode, (a, b) in events:
            samples[mode].append(a.elapsed_time(b) / calls)
    fa_backend.disable()
    return _summary(samples, statistics.median)


def _host_modes(fn, n: int = 40, rounds: int = 60):
    """Wall time per call (µs), the modes interleaved round by round (their order rotated) so drifts
    of the host hit all three alike; the minimum over rounds (host noise only ever adds time)."""
    samples = {mode: [] for mode in _MODES}
    for mode in _MODES:
        with _switch(mode):
            for _ in range(20):
                fn()
    for r in range(rounds):
        for mode in _MODES[r % 3:] + _MODES[:r % 3]:  # rotated: no mode always runs right after another
            with _switch(mode):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                torch.cuda.synchronize()
                samples[mode].append((time.perf_counter() - t0) / n * 1e6)
    fa_backend.disable()
    return _summary(samples, min)


def _cases():
    for embed, heads in ((512, 16), (1024, 16), (2048, 16)):
        for s in (128, 512, 2048, 8192):
            yield embed, heads, s, TOKENS // s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds per GPU-bound case")
    parser.add_argument("--host-only", action="store_true", help="only the tiny host-bound cases")
    args = parser.parse_args()
    globals()["ROUNDS"] = args.rounds
    _warm_gpu()
    records = []
    torch.manual_seed(0)

    def report(name, embed, heads, s, b, times, unit):
        rec = dict(case=name, embed=embed, heads=heads, d=embed // heads, seqlen=s, batch=b, unit=unit, **times)
        records.append(rec)
        print(f"{name:<22} E={embed:<5} h={heads:<3} s={s:<5} b={b:<4} off {times['off']:9.3f}  "
              f"on {times['on']:9.3f} ({times['ratio_on']:.3f}x)  on_torch {times['on_torch']:9.3f} "
              f"({times['ratio_on_torch']:.3f}x) {unit}  (x: paired median of off / mode)", flush=True)

    for embed, heads, s, b in () if args.host_only else _cases():
        mha = nn.MultiheadAttention(embed, heads, batch_first=True, device="cuda", dtype=DT).eval()
        x = torch.randn(b, s, embed, device="cuda", dtype=DT)
        with torch.no_grad():
            report("mha_eval", embed, heads, s, b, _modes(lambda: mha(x, x, x, need_weights=False)), "ms")
            causal = nn.Transformer.generate_square_subsequent_mask(s, "cuda", DT)
            report("mha_eval_causal", embed, heads, s, b,
                   _modes(lambda: mha(x, x, x, need_weights=False, attn_mask=causal, is_causal=True)), "ms")
        mha.train()
        xg = x.clone().requires_grad_()

        def train_step():
            y = mha(xg, xg, xg, need_weights=False)[0]
            y.backward(torch.ones_like(y))

        report("mha_train_fwd_bwd", embed, heads, s, b, _modes(train_step), "ms")
        layer = nn.TransformerEncoderLayer(embed, heads, 4 * embed, dropout=0.0, batch_first=True, device="cuda",
                                           dtype=DT).eval()
        with torch.no_grad():
            report("encoder_layer_eval", embed, heads, s, b, _modes(lambda: layer(x)), "ms")
        layer.train()

        def layer_step():
            layer(xg).backward(torch.ones_like(xg))

        report("encoder_layer_train", embed, heads, s, b, _modes(layer_step), "ms")
        del mha, layer, x, xg
        torch.cuda.empty_cache()

    # host-bound: one tiny call, wall time per call (2 heads: PyTorch's fast path applies; 1: it does not)
    for heads in (1, 2):
        mha = nn.MultiheadAttention(64, heads, batch_first=True, device="cuda", dtype=DT).eval()
        x = torch.randn(1, 16, 64, device="cuda", dtype=DT)
        with torch.no_grad():
            report("mha_eval_tiny_host", 64, heads, 16, 1,
                   _host_modes(lambda: mha(x, x, x, need_weights=False)), "us")
        layer = nn.TransformerEncoderLayer(64, heads, 128, dropout=0.0, batch_first=True, device="cuda",
                                           dtype=DT).eval()
        with torch.no_grad():
            report("encoder_layer_tiny_host", 64, heads, 16, 1, _host_modes(lambda: layer(x)), "us")
        layer.train()
        xg = x.clone().requires_grad_()
        report("encoder_layer_train_tiny_host", 64, heads, 16, 1,
               _host_modes(lambda: layer(xg).sum().backward(), n=10), "us")
    write_records(args.json, records)


if __name__ == "__main__":
    main()
