"""The benchmark's pure parts on synthetic records (table, --shape, outputs, plot, clocks), the CPU
exit path, and a GPU smoke run of `python -m fa_backend bench --out DIR`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from fa_backend import bench
from fa_backend.bench import Record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("backend", "d", "causal", "seqlen", "batch", "heads", "dtype", "fwd_tflops", "bwd_tflops",
          "fwd_ms", "bwd_ms", "fwd_first_ms", "bwd_first_ms", "error")


def _records() -> list[Record]:
    def rec(backend, seqlen, fwd, bwd, error=None):
        batch, heads = bench.standard_shape(seqlen, 128)
        flops = bench.attention_flops(batch, heads, seqlen, seqlen, 128, True)
        r = Record(backend, 128, True, seqlen, batch, heads, "bfloat16", error=error)
        if fwd:  # ms from TFLOP/s, as bench_one derives TFLOP/s from ms
            r.fwd_tflops, r.fwd_ms, r.fwd_first_ms = fwd, flops / fwd * 1e-9, 100.0
        if bwd:
            r.bwd_tflops, r.bwd_ms, r.bwd_first_ms = bwd, 2.5 * flops / bwd * 1e-9, 200.0
        return r

    return [rec("triton", 4096, 300.0, 250.0), rec("flash", 4096, 250.0, 200.0), rec("cudnn", 4096, 400.0, 125.0),
            rec("efficient", 4096, None, None, error="No available kernel. Aborting execution."),
            rec("triton", 8192, 320.0, 260.0), rec("cudnn", 8192, 160.0, 130.0)]


def test_table_has_ms_tflops_first_call_and_best_peer_ratio():
    out = io.StringIO()
    bench.print_table(_records(), ["triton", "flash", "cudnn", "efficient"], out=out)
    text = out.getvalue()
    assert "fwd TFLOP/s, d=128, causal=True, bfloat16" in text and "bwd TFLOP/s, d=128, causal=True" in text
    fwd, bwd = text.split("bwd TFLOP/s")
    ours_4096 = next(line for line in fwd.splitlines() if "4096" in line and "triton" in line)
    # forward: best peer at 4096 is cudnn (400): ours 300 / 400; at 8192 cudnn 160: ours 2.00x
    assert "0.75x (cudnn)" in ours_4096 and " 300.0" in ours_4096 and " 100.0" in ours_4096
    assert any("2.00x (cudnn)" in line for line in fwd.splitlines() if "triton" in line)
    assert any(line.split()[0] == "flash" and "0.62x" in line for line in fwd.splitlines() if line.strip())
    assert "efficient  error: No available kernel" in fwd
    # backward: best peer at 4096 is flash (200): ours 250 / 200
    assert "1.25x (flash)" in bwd and "2.00x (cudnn)" in bwd
    # ms column: the value bench_one would have measured
    ms = _records()[0].fwd_ms
    assert f"{ms:8.3f}" in ours_4096


def test_best_peer_ignores_ours_errors_and_missing_values():
    recs = _records()[:4]
    assert bench.best_peer(recs, "fwd") == ("cudnn", 400.0)
    assert bench.best_peer(recs, "bwd") == ("flash", 200.0)
    assert bench.best_peer(recs[:1], "fwd") is None


def test_fwd_only_prints_no_backward_table():
    recs = [dataclasses.replace(r, bwd_tflops=None, bwd_ms=None, bwd_first_ms=None) for r in _records()]
    out = io.StringIO()
    bench.print_table(recs, out=out)
    assert "fwd TFLOP/s" in out.getvalue() and "bwd TFLOP/s" not in out.getvalue()


def test_shape_parsing():
    assert bench.parse_shape("2,16,4096,128") == (2, 16, 4096, 128)
    assert bench.parse_shape(" 1, 8 ,512,64") == (1, 8, 512, 64)
    for bad in ("2,16,4096", "2,16,4096,128,1", "a,b,c,d", "0,16,4096,128", "2,16,-1,64", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="B,H,S,D"):
            bench.parse_shape(bad)


def test_malformed_shape_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--shape", "2,16,4096"])
    assert e.value.code == 2
    assert "argument --shape: expected B,H,S,D" in capsys.readouterr().err


def test_sweep_uses_given_shapes_or_the_standard_one():
    shapes = [(2, 16, 4096, 128), (1, 8, 512, 64), (4, 16, 1024, 128)]
    got = bench.sweep([64], [1024], [False, True], shapes)
    assert sorted(got) == sorted((b, h, s, d, c) for b, h, s, d in shapes for c in (False, True))
    assert bench.sweep([64, 128], [512, 16384], [True], None) == [
        (32, 32, 512, 64, True), (1, 32, 16384, 64, True), (32, 16, 512, 128, True), (1, 16, 16384, 128, True)]


def test_backend_selection():
    none = {"flash_attn": None}
    assert bench.available_backends(None, False, none) == ["triton", "flash", "cudnn", "efficient"]
    assert bench.available_backends(None, True, {"flash_attn": "2.7.4"}) == [
        "triton", "flash", "cudnn", "efficient", "flash_attn", "flex"]
    assert bench.available_backends(["triton", "flash"], True, none) == ["triton", "flash", "flex"]
    assert bench.available_backends(["triton", "flex"], True, none) == ["triton", "flex"]


def test_clock_parsing():
    got = bench.parse_clocks("1980 MHz, 2619 MHz, 1980 MHz, 3201 MHz, 550.54.15\n")
    assert got == {"sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "max_sm_clock_mhz": 1980,
                   "max_mem_clock_mhz": 3201, "driver": "550.54.15"}
    got = bench.parse_clocks("[N/A], 2619 MHz, [N/A]")
    assert got == {"sm_clock_mhz": None, "mem_clock_mhz": 2619, "max_sm_clock_mhz": None,
                   "max_mem_clock_mhz": None, "driver": None}


def test_gpu_clocks_without_nvidia_smi_is_all_none(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert bench.gpu_clocks() == dict.fromkeys(bench.CLOCK_FIELDS)


def test_progress_line():
    out = io.StringIO()
    ticks = iter(range(100, 200, 5))
    p = bench.Progress(48, stream=out, clock=lambda: next(ticks))
    for i in range(12):
        p.step(f"triton d=128 causal s={i}")
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 12 and lines[0] == "[ 1/48] triton d=128 causal s=0  (at 0 s)", lines[0]
    assert lines[-1] == "[12/48] triton d=128 causal s=11  (at 55 s)", lines[-1]


def test_records_are_written_as_they_come(tmp_path, monkeypatch, capsys):
    """The JSON files hold every finished measurement, marked partial, while the run goes: a run that stops (here
    interrupted in its third measurement) keeps the first two."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "test", "external_packages": {}})
    seen = []

    def one(backend, d, causal, s, dtype, **kw):
        if len(seen) == 2:
            for path in (tmp_path / "a.json", tmp_path / "out" / "bench.json"):
                data = json.loads(path.read_text())
                assert data["partial"] == "2/4" and [r["seqlen"] for r in data["records"]] == [512, 512], data
            raise KeyboardInterrupt
        seen.append(backend)
        return bench.Record(backend, d, causal, s, 1, 1, "bfloat16", fwd_ms=1.0, fwd_tflops=2.0)

    monkeypatch.setattr(bench, "bench_one", one)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--dims", "64", "--seqlens", "512", "1024", "--causal", "no", "--backends", "triton", "flash",
                    "--json", str(tmp_path / "a.json"), "--out", str(tmp_path / "out")])
    assert seen == ["triton", "flash"]
    data = json.loads((tmp_path / "a.json").read_text())
    assert data["environment"]["gpu"] == "test" and [r["backend"] for r in data["records"]] == ["triton", "flash"]
    assert not list(tmp_path.glob("**/*.tmp"))


@pytest.mark.parametrize("causal", [False, True])
def test_flex_runner_matches_sdpa_forward(causal):
    """The FlexAttention backend's call (compiled flex_attention, causal block mask) on CPU, forward only
    (FlexAttention has no CPU backward)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    import torch._dynamo.config as dynamo_config

    # the runner raises these limits; restored after the test by assignment: pytest's monkeypatch undoes an
    # attribute missing from the module's __dict__ by delattr, which hides a torch >= 2.14 config entry for good
    saved = {name: getattr(dynamo_config, name) for name in ("cache_size_limit", "recompile_limit")
             if hasattr(dynamo_config, name)}
    try:
        fn = bench._flex_runner(causal)
        q, k, v = (torch.randn(1, 256, 2, 64).transpose(1, 2) for _ in range(3))
        torch.testing.assert_close(fn(q, k, v),
                                   torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
    finally:
        for name, value in saved.items():
            setattr(dynamo_config, name, value)


def test_missing_or_unknown_backend_is_unavailable():
    with pytest.raises(bench.BackendUnavailable, match="unknown backend"):
        bench._runner("nonesuch", False)
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(bench.BackendUnavailable, match="flash_attn not installed"):
            bench._runner("flash_attn", True)
        assert bench.external_packages()["flash_attn"] is None
    if not torch.cuda.is_available():  # our CuTe forward needs a Hopper GPU besides the DSL
        assert bench.external_packages()["cutlass"] is None
        with pytest.raises(bench.BackendUnavailable, match="Hopper"):
            bench._runner("cute", False)


def _result() -> dict:
    return {"environment": {"gpu": "synthetic", "torch": torch.__version__, "triton": "x",
                            "clocks": dict.fromkeys(bench.CLOCK_FIELDS)},
            "records": [dataclasses.asdict(r) for r in _records()]}


def test_write_outputs_json(tmp_path):
    paths = bench.write_outputs(_result(), str(tmp_path / "run"), stream=io.StringIO())
    assert paths[0] == str(tmp_path / "run" / "bench.json")
    data = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert data["environment"]["gpu"] == "synthetic"
    assert len(data["records"]) == 6 and all(set(FIELDS) <= set(r) for r in data["records"])
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (len(paths) == 2) == has_mpl and os.path.exists(tmp_path / "run" / "bench.png") == has_mpl


def test_write_outputs_without_matplotlib_says_so(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    err = io.StringIO()
    assert bench.write_outputs(_result(), str(tmp_path), stream=err) == [str(tmp_path / "bench.json")]
    assert "matplotlib is not installed" in err.getvalue() and not os.path.exists(tmp_path / "bench.png")


def test_plot_of_synthetic_records(tmp_path):
    pytest.importorskip("matplotlib")
    from fa_backend.bench_report import markdown, plot

    plot(_result(), str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 4096 | 300 | 250 | 400 | - | 1.20x | 0.75x | - |" in markdown(_result())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_on_cpu_exits_2_with_message():
    res = subprocess.run([sys.executable, "-m", "fa_backend", "bench", "--out", "unused"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 2 and "bench needs a CUDA GPU" in res.stderr and not os.path.exists(
        os.path.join(ROOT, "unused"))


@pytest.mark.gpu
def test_bench_out_dir_on_gpu(tmp_path, capsys):
    assert bench.main(["--dims", "64", "--seqlens", "1024", "--causal", "no", "--backends", "triton", "flash",
                       "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "fwd TFLOP/s, d=64, causal=False" in captured.out and "[1/2] triton d=64" in captured.err
    data = json.loads((tmp_path / "bench.json").read_text())
    env = data["environment"]
    for key in ("gpu", "torch", "triton", "cuda", "cudnn", "clocks", "external_packages"):
        assert key in env
    assert [r["backend"] for r in data["records"]] == ["triton", "flash"]
    for r in data["records"]:
        assert set(FIELDS) <= set(r) and r["error"] is None, r
        assert (r["d"], r["causal"], r["seqlen"], r["batch"], r["heads"], r["dtype"]) == (
            64, False, 1024, 16, 32, "bfloat16")
        assert r["fwd_tflops"] > 0 and r["bwd_tflops"] > 0 and r["fwd_first_ms"] > 0 and r["bwd_first_ms"] > 0


def test_interleaved_timing_takes_variants_in_turn():
    order = []
    variants = [(name, (lambda name=name: order.append(name)), contextlib.nullcontext) for name in ("a", "b")]
    samples = bench._interleaved_us(variants, n=3, rounds=2, sync=lambda: None)
    assert set(samples) == {"a", "b"} and all(len(v) == 2 and min(v) > 0 for v in samples.values())
    assert order == ["a"] * 100 + ["b"] * 100 + ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback path")
def test_host_overhead_on_cpu_reports_the_routing_overhead():
    import fa_backend

    fa_backend.reset_stats()
    result = bench.host_overhead("cpu", n=5, rounds=3)
    assert set(result) == {bench.SDPA_UNROUTED, bench.SDPA_ROUTED,
                           "routing overhead, default order (routed - not routed)"}
    assert result[bench.SDPA_UNROUTED] > 0 and result[bench.SDPA_ROUTED] > 0
    assert fa_backend.stats()["runs"].get("torch", 0) + fa_backend.stats()["runs"].get("math", 0) >= 3 * 5


def test_graph_timed_forward_tables_say_so():
    records = _records()
    for r in records:
        r.fwd_timing = "graph"
    buf = io.StringIO()
    bench.print_table(records, out=buf)
    text = buf.getvalue()
    assert "fwd TFLOP/s, d=128, causal=True, bfloat16 (CUDA-graph replays: GPU time only)" in text
    assert "bwd TFLOP/s, d=128, causal=True, bfloat16\n" in text  # the backward stays eager


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_graph_option_parses():
    assert bench.main(["--graph", "--dims", "64", "--seqlens", "512"]) == 2  # parsed; then the CPU exit


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_graph_timed_forward_on_gpu(backend):
    rec = bench.bench_one(backend, 64, False, 512, torch.bfloat16, backward=True, batch=2, heads=2, graph=True)
    assert rec.error is None and rec.fwd_timing == "graph" and rec.fwd_ms > 0 and rec.bwd_ms > 0


def test_kv_heads_must_divide_the_query_heads(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--shape", "2,32,4096,128", "--shape", "2,12,4096,128", "--kv-heads", "8"])
    assert e.value.code == 2
    assert "--kv-heads 8 must divide the query heads of every shape (12, 32)" in capsys.readouterr().err


def test_gqa_rows_show_query_and_key_value_heads():
    mha = _records()[:2]
    gqa = [dataclasses.replace(r, heads_kv=r.heads // 4, fwd_tflops=r.fwd_tflops * 0.9) for r in mha]
    out = io.StringIO()
    bench.print_table(mha + gqa, out=out)
    fwd = out.getvalue().split("bwd TFLOP/s")[0]
    h = mha[0].heads
    gqa_row = next(line for line in fwd.splitlines() if f" {h}:{h // 4} " in line)
    mha_row = next(line for line in fwd.splitlines() if f" {h} " in line and ":" not in line and "triton" in line)
    assert "triton" in gqa_row and "1.20x (flash)" in gqa_row and "1.20x (flash)" in mha_row  # each vs its own peers


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flash", "cudnn"])
def test_gqa_bench_on_gpu(backend):
    rec = bench.bench_one(backend, 128, True, 512, torch.bfloat16, backward=True, batch=2, heads=8, heads_kv=2)
    assert rec.heads_kv == 2
    assert rec.error is None or backend == "cudnn", rec.error  # cuDNN may refuse GQA on some versions
    if rec.error is None:
        assert rec.fwd_ms > 0 and rec.bwd_ms > 0


def test_flash_attention_4_is_an_external_peer(tmp_path, monkeypatch):
    # FlashAttention-4 installs `flash_attn.cute` inside a namespace package `flash_attn`: that namespace alone
    # must not count as FlashAttention-2, and the fa4 backend needs the flash-attn-4 distribution.
    pkg = tmp_path / "flash_attn" / "cute"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def flash_attn_func(q, k, v, causal=False):\n    return q * 2, None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    # the fake modules this test imports must not outlive it: recorded as absent (setitem, then delitem), the two
    # names are removed again at teardown, whatever the imports below put there
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.delitem(sys.modules, "flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.delitem(sys.modules, "flash_attn.cute")
    from importlib import metadata

    def installed(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    found = bench.external_packages()
    # the namespace alone is no flash-attn distribution, a stray module no flash-attn-4 one (where the real
    # packages are installed, as on the GPU machine, their versions are reported)
    assert found["flash_attn"] == installed("flash-attn")
    assert found["flash_attn.cute"] == installed("flash-attn-4")
    fn, _ = bench._runner("fa4", True)
    q = torch.randn(1, 3, 5, 8)
    torch.testing.assert_close(fn(q, q, q), q * 2)  # (b, h, s, d) in and out through FA4's (b, s, h, d)
    from fa_backend.bench_report import LABELS

    assert "fa4" in bench.EXTERNAL and LABELS["fa4"].startswith("FlashAttention-4")
