"""`python -m fa_backend bench`: TFLOP/s of our kernels against PyTorch's SDPA backends (GPU).

Backends: ours (`triton`), PyTorch's SDPA kernels (`flash`, `cudnn`, `efficient`), FlexAttention
with `--flex` (`torch.compile(flex_attention)`, causal through a block mask), and FlashAttention-2's
`flash_attn_func` (`flash_attn`) and FlashAttention-4's (`fa4`, package `flash-attn-4`, module
`flash_attn.cute`) when those packages are installed. Shapes: the standard sweep
(batch = 16384 / seqlen, heads = 2048 / d, over --dims x --seqlens) or exactly the shapes given
with --shape B,H,S,D; --kv-heads N makes every shape GQA (N key/value heads; PyTorch's backends are
called with enable_gqa=True, FLOPs are those of the query heads). Prints, on stdout, per shape and
backend: ms, TFLOP/s, the first call's time and the ratio of TFLOP/s to the best peer (the fastest
backend other than ours on that shape); progress goes to stderr.
--out DIR writes DIR/bench.json (environment: GPU, clocks, driver, CUDA/cuDNN/torch/triton
versions; records) and DIR/bench.png (needs matplotlib).

All numbers of one table come from one process on one GPU: ratios within a run are comparable,
absolute figures across runs are not. Steady-state timings are CUDA-event medians
(triton.testing.do_bench) after warm-up, on random data. The first call of each (backend, shape)
is timed on its own (wall clock, synchronized): it includes compilation when this process has not
yet built the kernel it needs. Our Triton kernels have no runtime autotuning: their tile sizes
come from fixed tables (fa_backend/kernels/triton/_configs.py), and Triton keeps compiled kernels
in its on-disk cache (~/.triton/cache, or $TRITON_CACHE_DIR), so a second run's first calls load
kernels instead of compiling them. FlexAttention is compiled by torch.compile, whose own caches apply.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TextIO

import torch
import torch.nn.functional as F

PEERS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
OURS = "triton"
DEFAULT_BACKENDS = [OURS, *PEERS]
# backend name -> package (module) it needs; added when installed ("cute": our CuTe DSL forward, which needs
# nvidia-cutlass-dsl and a Hopper GPU)
EXTERNAL = {"flash_attn": "flash_attn", "fa4": "flash_attn.cute", "cute": "cutlass"}
# module -> the distribution whose version is recorded (FlashAttention-4 ships `flash_attn.cute` in a namespace
# package `flash_attn`, so the module alone does not say that FlashAttention-2 is installed)
DISTRIBUTIONS = {"flash_attn": "flash-attn", "flash_attn.cute": "flash-attn-4"}


class BackendUnavailable(RuntimeError):
    """A backend that cannot run in this environment (feature or package missing): recorded as an error."""


def calls_per_sample(seqlen: int) -> int:
    """Calls per timed sample: the host enqueues several calls back to back, as a model's eager loop
    does, so per-call Python overhead overlaps GPU work instead of sitting inside every sample (only
    the first call's host time remains, spread over the sample). Short sequences get more calls."""
    return 16 if seqlen <= 2048 else 4


@dataclasses.dataclass
class Record:
    backend: str
    d: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    dtype: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_tflops: float | None = None
    fwd_first_ms: float | None = None  # first call for this (backend, shape) in this process, compile included
    bwd_first_ms: float | None = None
    error: str | None = None
    fwd_timing: str = "eager"  # "eager": calls from Python (host overhead overlaps); "graph": CUDA-graph replays
    heads_kv: int | None = None  # GQA: key/value heads (None: as many as the query heads)


def attention_flops(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward FLOPs (two GEMMs, 2 FLOPs per MAC), halved for causal; backward is 2.5x this."""
    flops = 4.0 * batch * heads * sq * sk * d
    return flops / 2 if causal else flops


_FLEX: dict = {}  # the compiled flex_attention and its causal block masks, built once per process


def _flex_runner(causal: bool, gqa: bool = False) -> Callable:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise BackendUnavailable(f"FlexAttention unavailable in torch {torch.__version__}: {e}") from e
    if "fn" not in _FLEX:
        # Static shapes (one specialised kernel per shape, as a model with fixed shapes gets), and room for
        # every shape of a sweep before Dynamo's recompile limit would fall back to eager flex_attention.
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v):  # the block mask is built on a shape's first call (counted in its first-call time)
        mask = None
        if causal:
            key = (q.shape[-2], k.shape[-2])
            if key not in _FLEX:
                _FLEX[key] = create_block_mask(causal_mod, None, None, key[0], key[1], device=q.device)
            mask = _FLEX[key]
        return _FLEX["fn"](q, k, v, block_mask=mask, enable_gqa=gqa) if gqa else _FLEX["fn"](q, k, v, block_mask=mask)

    return run


def _flash_attn_runner(causal: bool) -> Callable:
    try:
        from flash_attn import flash_attn_func
    except ImportError as e:
        raise BackendUnavailable(f"flash_attn not installed: {e}") from e
    # flash_attn_func takes (b, s, h, d); our inputs are (b, s, h, d) memory viewed as (b, h, s, d).
    return lambda q, k, v: flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           causal=causal).transpose(1, 2)


def _fa4_runner(causal: bool) -> Callable:
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as e:
        raise BackendUnavailable(f"flash-attn-4 not installed: {e}") from e
    # FlashAttention-4's flash_attn_func takes (b, s, h, d) (GQA by head counts) and returns (out, lse).
    return lambda q, k, v: flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           causal=causal)[0].transpose(1, 2)


def _runner(backend: str, causal: bool, gqa: bool = False) -> tuple[Callable, contextlib.AbstractContextManager]:
    """The call to time for `backend` and the context to run it in (`gqa`: fewer key/value heads than query
    heads); BackendUnavailable if it cannot run here."""
    if backend == OURS:
        import fa_backend

        return (lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal)), contextlib.nullcontext()
    if backend == "flex":
        return _flex_runner(causal, gqa), contextlib.nullcontext()
    if backend == "flash_attn":
        return _flash_attn_runner(causal), contextlib.nullcontext()
    if backend == "fa4":
        return _fa4_runner(causal), contextlib.nullcontext()
    if backend == "cute":
        if not external_packages().get("cutlass"):
            raise BackendUnavailable("cute needs nvidia-cutlass-dsl and a Hopper (sm90) GPU")
        from .ops.cute_flash import cute_flash_attention

        return (lambda q, k, v: cute_flash_attention(q, k, v, None, causal)[0]), contextlib.nullcontext()
    if backend not in PEERS:
        raise BackendUnavailable(f"unknown backend {backend!r}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ctx = sdpa_kernel(getattr(SDPBackend, PEERS[backend]))
    if gqa:
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)), ctx
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), ctx


def _inputs(batch: int, heads: int, seqlen: int, d: int, dtype: torch.dtype, heads_kv: int | None = None):
    # (b, s, h, d) memory viewed as (b, h, s, d): the layout a model's projections produce.
    return [torch.randn(batch, seqlen, h, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
            for h in (heads, heads_kv or heads, heads_kv or heads)]


def _first_call_ms(fn: Callable):
    """Runs fn once between two synchronizations; returns (its result, wall milliseconds)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - t0) * 1e3


def standard_shape(seqlen: int, d: int, tokens: int = 16384, width: int = 2048) -> tuple[int, int]:
    """(batch, heads) of the standard sweep: batch = tokens / seqlen, heads = width / d (at least 1)."""
    return max(1, tokens // seqlen), max(1, width // d)


def bench_one(backend: str, d: int, causal: bool, seqlen: int, dtype: torch.dtype, backward: bool,
              tokens: int = 16384, width: int = 2048, batch: int | None = None,
              heads: int | None = None, graph: bool = False, heads_kv: int | None = None) -> Record:
    """Times one backend on one shape (GPU). batch/heads default to the standard sweep's; heads_kv (GQA)
    to heads.

    The first forward (and first backward) call is timed alone, then steady state is the median
    of do_bench samples. With `graph`, the forward's steady state is timed as CUDA-graph replays of
    calls on inputs that need no grad (GPU time only: no host overhead, no L2 flush between calls);
    the backward keeps the eager timing. A backend that refuses the shape or is unavailable gets
    `error` set.
    """
    from triton.testing import do_bench, do_bench_cudagraph

    sb, sh = standard_shape(seqlen, d, tokens, width)
    batch, heads = batch or sb, heads or sh
    gqa = heads_kv is not None and heads_kv != heads
    rec = Record(backend, d, causal, seqlen, batch, heads, str(dtype).replace("torch.", ""),
                 heads_kv=heads_kv if gqa else None)
    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal)
    try:
        fn, ctx = _runner(backend, causal, gqa)
        q, k, v = _inputs(batch, heads, seqlen, d, dtype, heads_kv if gqa else None)
        with ctx:
            out, rec.fwd_first_ms = _first_call_ms(lambda: fn(q, k, v))
            repeat = calls_per_sample(seqlen)
            if graph:
                qd, kd, vd = (t.detach() for t in (q, k, v))
                rec.fwd_ms = do_bench_cudagraph(lambda: fn(qd, kd, vd), rep=100, return_mode="median")
                rec.fwd_timing = "graph"
            else:
                rec.fwd_ms = do_bench(lambda: [fn(q, k, v) for _ in range(repeat)],
                                      warmup=25, rep=100, return_mode="median") / repeat
            rec.fwd_tflops = flops / rec.fwd_ms * 1e-9
            if backward:
                dout = torch.randn_like(out)
                grad = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
                _, rec.bwd_first_ms = _first_call_ms(grad)
                rec.bwd_ms = do_bench(lambda: [grad() for _ in range(repeat)],
                                      warmup=25, rep=100, return_mode="median") / repeat
                rec.bwd_tflops = 2.5 * flops / rec.bwd_ms * 1e-9
    except Exception as e:  # a backend that refuses this shape (e.g. head dim), fails to compile or is missing
        rec.error = (str(e).splitlines() or [type(e).__name__])[0][:120]
    return rec


def peak_memory(seqlens: list[int], d: int = 64, batch: int = 2, heads: int = 16,
                dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Peak extra memory (MiB) of one forward + backward, ours vs PyTorch's math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa_backend

    rows = []
    for s in seqlens:
        row = {"seqlen": s, "batch": batch, "heads": heads, "d": d}
        for name in ("triton", "math"):
            q, k, v = _inputs(batch, heads, s, d, dtype)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if name == "triton":
                out = fa_backend.attention(q, k, v, is_causal=True)
            else:
                with sdpa_kernel(SDPBackend.MATH):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
            row[f"{name}_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            del q, k, v, out
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def _interleaved_us(variants: list[tuple], n: int, rounds: int, sync) -> dict[str, list[float]]:
    """{name: [wall µs per call, one per round]}: each variant (name, fn, context factory) timed on n calls
    back to back, the variants taken in turn round by round so that drifts of the host hit all alike."""
    samples: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for r in range(rounds + 1):
        for name, fn, context in variants:
            with context():
                if r == 0:  # warm-up round: compile, fill the router's caches
                    for _ in range(100):
                        fn()
                    continue
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                sync()
                samples[name].append((time.perf_counter() - t0) / n * 1e6)
    return samples


SDPA_UNROUTED = "F.scaled_dot_product_attention (not routed)"
SDPA_ROUTED = "F.scaled_dot_product_attention (routed)"
DECODE_DIRECT = "split-KV decode kernel (direct, what routed 16-query calls run)"
SDPA_ROUTED_TRITON = "F.scaled_dot_product_attention (routed, sdpa_backends(['triton']))"


def host_overhead(device: str = "cuda", n: int = 500, rounds: int = 15) -> dict[str, float]:
    """Eager wall time per tiny call (µs): b=1, h=1, s=16, d=64, so the host is the bottleneck.

    On CUDA (bf16): our op directly, the same call through routed F.scaled_dot_product_attention
    (default order, where a measured preference may pick PyTorch's kernel, and restricted to our
    Triton kernel), and PyTorch's own SDPA. On CPU (fp32, falls back to PyTorch): SDPA unrouted and routed.
    The variants are interleaved round by round; each figure is the median over the rounds, and the
    routing overheads are medians of the per-round differences (routed minus what it runs unrouted).
    """
    import fa_backend

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 1, 16, 64, device=device, dtype=dtype)
    qg = q.clone().requires_grad_()
    sdpa = lambda: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
    plain, routed = contextlib.nullcontext, fa_backend.enabled

    @contextlib.contextmanager
    def routed_triton():
        with fa_backend.enabled(), fa_backend.sdpa_backends(["triton"]):
            yield

    variants = [(SDPA_UNROUTED, sdpa, plain), (SDPA_ROUTED, sdpa, routed)]
    if device == "cuda":
        from .ops.triton_decode import sdpa_decode  # what a routed call with <= 16 queries runs

        variants += [
            ("fa_backend.attention (direct)", lambda: fa_backend.attention(q, q, q), plain),
            ("fa_backend.attention (direct, requires_grad)", lambda: fa_backend.attention(qg, qg, qg), plain),
            (DECODE_DIRECT, lambda: sdpa_decode(q, q, q, None, False, False, None), plain),
            (SDPA_ROUTED_TRITON, sdpa, routed_triton),
        ]
    samples = _interleaved_us(variants, n, rounds, sync)
    result = {name: statistics.median(v) for name, v in samples.items()}
    pairs = [("routing overhead, default order (routed - not routed)", SDPA_ROUTED, SDPA_UNROUTED),
             ("routing overhead onto the decode kernel (routed - direct)", SDPA_ROUTED_TRITON, DECODE_DIRECT)]
    for label, a, b in pairs:
        if a in samples and b in samples:
            result[label] = statistics.median(x - y for x, y in zip(samples[a], samples[b]))
    return result


CLOCK_QUERY = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,driver_version"
CLOCK_FIELDS = ("sm_clock_mhz", "mem_clock_mhz", "max_sm_clock_mhz", "max_mem_clock_mhz", "driver")


def parse_clocks(line: str) -> dict:
    """Parses one line of `nvidia-smi --query-gpu=CLOCK_QUERY --format=csv,noheader`
    (e.g. "1980 MHz, 2619 MHz, 1980 MHz, 3201 MHz, 550.54.15") into CLOCK_FIELDS; clocks in MHz as
    ints, the driver as a string, None where the field is missing or not a number ("[N/A]")."""
    parts = [p.strip() for p in line.strip().split(",")]
    result: dict = dict.fromkeys(CLOCK_FIELDS)
    for name, text in zip(CLOCK_FIELDS, parts):
        if name == "driver":
            result[name] = text if text and not text.startswith("[") else None
            continue
        number = text.split()[0] if text else ""
        result[name] = int(number) if number.isdigit() else None
    return result


def gpu_clocks(device_uuid: str | None = None, timeout: float = 10.0) -> dict:
    """Current and maximum SM/memory clocks and the driver version from nvidia-smi, all None if it
    is missing, fails or times out. With a UUID, that GPU; else the first one nvidia-smi lists."""
    cmd = ["nvidia-smi", f"--query-gpu={CLOCK_QUERY}", "--format=csv,noheader"]
    for args in ([f"--id={device_uuid}"], []) if device_uuid else ([],):
        try:
            res = subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError):
            break
        lines = res.stdout.strip().splitlines()
        if res.returncode == 0 and lines:
            return parse_clocks(lines[0])
    return dict.fromkeys(CLOCK_FIELDS)


def external_packages() -> dict[str, str | None]:
    """Version of each external kernel package a backend uses, None if it is not installed."""
    from importlib import metadata

    result: dict[str, str | None] = {}
    for module in EXTERNAL.values():
        if module == "cutlass":  # the DSL's distribution, usable for our kernels on sm90 only
            from .kernels.cute import DSL_AVAILABLE, DSL_VERSION

            hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            result[module] = DSL_VERSION if DSL_AVAILABLE and hopper else None
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # the parent package is missing
            found = False
        if not found:
            result[module] = None
            continue
        try:
            result[module] = metadata.version(DISTRIBUTIONS.get(module, module.replace("_", "-")))
        except metadata.PackageNotFoundError:
            # a namespace package left by another distribution is not this one
            result[module] = None if module in DISTRIBUTIONS else "installed (version unknown)"
    return result


def available_backends(requested: list[str] | None, flex: bool, installed: dict[str, str | None]) -> list[str]:
    """The backends to run: the requested list (default: ours and PyTorch's SDPA kernels, plus every
    installed external package's backend), with FlexAttention appended when `flex` is set."""
    backends = list(requested) if requested else DEFAULT_BACKENDS + [b for b, m in EXTERNAL.items() if installed.get(m)]
    if flex and "flex" not in backends:
        backends.append("flex")
    return backends


def _device_uuid() -> str | None:
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def environment() -> dict:
    """GPU (name, capability, SMs, clocks, driver) and versions (torch, triton, CUDA, cuDNN,
    Python, external kernel packages) of this run; needs CUDA."""
    import triton

    props = torch.cuda.get_device_properties(0)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(0)), "sms": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda, "cudnn": cudnn,
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "clocks": gpu_clocks(_device_uuid()), "external_packages": external_packages(),
            "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR", os.path.join("~", ".triton", "cache"))}


class Progress:
    """A one-line progress indicator, `[ 12/48] label`, on a stream (stderr). On a terminal the line
    is rewritten in place; elsewhere (a log file) each step is its own line, ending with the seconds
    since the first step started (`at 85 s`): the gaps between lines are each step's time."""

    def __init__(self, total: int, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.total, self.count = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._width = 0
        self._clock, self._start = clock, None

    def line(self, label: str) -> str:
        """The text shown for the next step."""
        w = len(str(self.total))
        return f"[{self.count + 1:{w}d}/{self.total}] {label}"

    def step(self, label: str) -> None:
        """Shows that the next step, `label`, starts."""
        text = self.line(label)
        now = self._clock()
        if self._start is None:
            self._start = now
        if self.tty:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self.stream.write(f"{text}  (at {now - self._start:.0f} s)\n")
        self.stream.flush()
        self.count += 1

    def close(self) -> None:
        """Ends the line on a terminal."""
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(x: float | None) -> str:
    return f"{x:7.1f}" if x is not None else "      -"


def best_peer(records: list[Record], direction: str) -> tuple[str, float] | None:
    """The fastest backend other than ours among `records` (one shape) in `direction`, as (name, TFLOP/s)."""
    peers = [(getattr(r, f"{direction}_tflops"), r.backend) for r in records if r.backend != OURS]
    peers = [(t, b) for t, b in peers if t]
    if not peers:
        return None
    t, b = max(peers)
    return b, t


def format_table(records: list[Record], direction: str) -> list[str]:
    """Lines of one direction's table for records of one (d, causal): per shape and backend, ms,
    TFLOP/s, the first call's ms, and the ratio of TFLOP/s to the best peer (the fastest backend
    other than ours in that shape; named on our row)."""
    lines = [f"  batch heads seqlen  {'backend':10} {'ms':>8} {'TFLOP/s':>8} {'first ms':>9}  vs best peer"]
    shapes = sorted({(r.seqlen, r.batch, r.heads, r.heads_kv or r.heads) for r in records})
    for s, b, h, hkv in shapes:
        rows = [r for r in records if (r.seqlen, r.batch, r.heads, r.heads_kv or r.heads) == (s, b, h, hkv)]
        best = best_peer(rows, direction)
        for i, r in enumerate(rows):
            heads = f"{h}" if hkv == h else f"{h}:{hkv}"  # query:key/value heads (GQA)
            shape = f"{b:7d} {heads:>5} {s:6d}" if i == 0 else " " * 20
            if r.error:
                lines.append(f"{shape}  {r.backend:10} error: {r.error[:70]}")
                continue
            ms, tflops, first = (getattr(r, f"{direction}_{k}") for k in ("ms", "tflops", "first_ms"))
            ms_text = f"{ms:8.3f}" if ms is not None else "       -"
            first_text = f"{first:9.1f}" if first is not None else "        -"
            ratio = "-"
            if best and tflops:
                ratio = f"{tflops / best[1]:.2f}x" + (f" ({best[0]})" if r.backend == OURS else "")
            lines.append(f"{shape}  {r.backend:10} {ms_text} {_fmt(tflops):>8} {first_text}  {ratio}")
    return lines


def print_table(records: list[Record], backends: list[str] | None = None, out: TextIO | None = None) -> None:
    """Prints one table per (direction, d, causal, dtype) group; `backends` orders rows (default: as recorded)."""
    out = out if out is not None else sys.stdout
    order = {b: i for i, b in enumerate(backends or dict.fromkeys(r.backend for r in records))}
    records = sorted(records, key=lambda r: order.get(r.backend, len(order)))
    for d, causal, dtype in sorted({(r.d, r.causal, r.dtype) for r in records}):
        group = [r for r in records if (r.d, r.causal, r.dtype) == (d, causal, dtype)]
        for direction in ("fwd", "bwd"):
            if direction == "bwd" and all(r.bwd_tflops is None for r in group):
                continue
            graph = direction == "fwd" and any(r.fwd_timing == "graph" for r in group)
            print(f"\n{direction} TFLOP/s, d={d}, causal={causal}, {dtype}"
                  + (" (CUDA-graph replays: GPU time only)" if graph else ""), file=out)
            for line in format_table(group, direction):
                print(line, file=out)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """`B,H,S,D` (positive integers) -> (batch, heads, seqlen, d); argparse.ArgumentTypeError otherwise."""
    parts = text.split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected B,H,S,D as four positive integers (e.g. 2,16,4096,128), got {text!r}")
    return shape  # type: ignore[return-value]


def sweep(dims: list[int], seqlens: list[int], causals: list[bool],
          shapes: list[tuple[int, int, int, int]] | None) -> list[tuple[int, int, int, int, bool]]:
    """(batch, heads, seqlen, d, causal) to run: exactly `shapes` if given, else the standard sweep."""
    if shapes:
        return [(b, h, s, d, c) for d in dict.fromkeys(x[3] for x in shapes) for c in causals
                for b, h, s, dd in shapes if dd == d]
    return [(*standard_shape(s, d), s, d, c) for d in dims for c in causals for s in seqlens]


def write_partial(paths: list[str], env: dict, records: list[Record], total: int) -> None:
    """Writes the records measured so far to each of `paths` as JSON, `"partial": "<done>/<total>"` added (a
    run's final JSON has no such key)."""
    result = {"environment": env, "partial": f"{len(records)}/{total}",
              "records": [dataclasses.asdict(r) for r in records]}
    for path in paths:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)  # (a reader never sees a half-written file)


def write_outputs(result: dict, out_dir: str, stream: TextIO | None = None) -> list[str]:
    """Writes `result` ({"environment", "records", ...}) to out_dir/bench.json and its plot to
    out_dir/bench.png (skipped, with a note on `stream` (stderr), when matplotlib is missing).
    Returns the paths written."""
    stream = stream if stream is not None else sys.stderr
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "bench.json")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1)
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no bench.png (pip install matplotlib, or the [bench] extra)", file=stream)
        return paths
    from .bench_report import plot

    paths.append(os.path.join(out_dir, "bench.png"))
    plot(result, paths[1])
    return paths


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark from command-line arguments; returns the exit status (2 without CUDA)."""
    parser = argparse.ArgumentParser(prog="python -m fa_backend bench", description=__doc__.splitlines()[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--shape", type=parse_shape, action="append", metavar="B,H,S,D",
                        help="run exactly this shape (batch, heads, seqlen, head dim) instead of the standard "
                             "sweep over --dims x --seqlens; repeatable")
    parser.add_argument("--kv-heads", type=int, metavar="N",
                        help="GQA: N key/value heads for every shape (must divide its query heads)")
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--backends", nargs="+",
                        help=f"default: {' '.join(DEFAULT_BACKENDS)}, plus {', '.join(EXTERNAL)} when installed; "
                             "also: flex, " + ", ".join(EXTERNAL))
    parser.add_argument("--flex", action="store_true", help="also FlexAttention (torch.compile(flex_attention))")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--fwd-only", action="store_true")
    parser.add_argument("--graph", action="store_true",
                        help="time the forward as CUDA-graph replays (GPU time only, no host overhead): separates "
                             "kernel speed from eager host cost on small shapes")
    parser.add_argument("--memory", action="store_true", help="also report peak memory vs the math backend")
    parser.add_argument("--overhead", action="store_true", help="also report host time per tiny eager call")
    parser.add_argument("--overhead-only", action="store_true",
                        help="only the host-time report (works without a GPU: the CPU fallback path)")
    parser.add_argument("--out", metavar="DIR", help="write DIR/bench.json and DIR/bench.png (plot needs matplotlib)")
    parser.add_argument("--json", help="write the records (and environment) to this file; it and --out's "
                                       "bench.json are rewritten after each measurement, with a \"partial\" key "
                                       "until the run ends")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--features", action="store_true",
                        help="masks and dropout instead (fa_backend.bench_features): causal given as an explicit "
                             "mask, key padding, dropout 0.1, against the efficient and cuDNN backends "
                             "(default dims 128, seqlens 2k-16k)")
    args = parser.parse_args(argv)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    shapes = sweep(args.dims, args.seqlens, causals, args.shape)
    if args.kv_heads is not None and any(args.kv_heads < 1 or h % args.kv_heads for _, h, _, _, _ in shapes):
        parser.error(f"--kv-heads {args.kv_heads} must divide the query heads of every shape "
                     f"({', '.join(map(str, sorted({h for _, h, _, _, _ in shapes})))})")
    if args.overhead_only:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for name, us in host_overhead(device).items():
            print(f"  {name:48} {us:7.1f} us per call ({device})")
        return 0
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU (use --overhead-only on CPU)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.features:
        from . import bench_features

        dims = args.dims if args.dims != [64, 128] else [128]
        seqlens = [s for s in args.seqlens if s >= 2048]
        backends = [b for b in (args.backends or DEFAULT_BACKENDS) if b in (OURS, *bench_features.PEERS)]
        from .kernels.cute import DSL_AVAILABLE

        if DSL_AVAILABLE and (args.backends is None or "cute" in args.backends):
            backends.insert(1, "cute")  # the CuTe kernels' key masks
        feats = bench_features.run(dims=dims, seqlens=seqlens, backends=backends, dtype=dtype,
                                   backward=not args.fwd_only)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": environment(), "features": [dataclasses.asdict(r) for r in feats]}, f,
                          indent=1)
        return 0
    env = environment()
    backends = available_backends(args.backends, args.flex, env["external_packages"])
    print(json.dumps(env))
    todo = [(backend, shape) for shape in shapes for backend in backends]
    progress = Progress(len(todo))
    records = []
    # the JSON files are rewritten after every shape and backend, marked partial until the run ends: a run cut
    # short (interrupted, or stuck in a call that does not return) keeps what it measured
    json_paths = [p for p in (args.json, args.out and os.path.join(args.out, "bench.json")) if p]
    for backend, (batch, heads, s, d, causal) in todo:
        progress.step(f"{backend} d={d} {'causal' if causal else 'non-causal'} b={batch} h={heads} s={s}")
        rec = bench_one(backend, d, causal, s, dtype, backward=not args.fwd_only, batch=batch, heads=heads,
                        graph=args.graph, heads_kv=args.kv_heads)
        torch.cuda.empty_cache()
        records.append(rec)
        write_partial(json_paths, env, records, len(todo))
    progress.close()
    print_table(records, backends)
    env["clocks_end"] = gpu_clocks(_device_uuid())
    result = {"environment": env, "records": [dataclasses.asdict(r) for r in records]}
    if args.memory:
        result["memory"] = peak_memory([1024, 2048, 4096])
        print("\npeak extra memory of fwd+bwd (MiB), causal, b=2 h=16 d=64 bf16")
        for row in result["memory"]:
            print(f"  s={row['seqlen']:5d}: triton {row['triton_mib']:8.1f}   math {row['math_mib']:8.1f}")
    if args.overhead:
        result["host_overhead_us"] = host_overhead()
        print("\nhost time per tiny eager call (b=1 h=1 s=16 d=64 bf16)")
        for name, us in result["host_overhead_us"].items():
            print(f"  {name:48} {us:7.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        from .bench_report import plot

        plot(result, args.plot)
    if args.out:
        for path in write_outputs(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
