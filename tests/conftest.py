"""Test setup: kernels run on CUDA when present, else in Triton's CPU interpreter."""

import os
import warnings

import torch

if not torch.cuda.is_available():
    # Must be set before Triton kernels are defined (fa_backend.kernels imports them).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import _interpreter, _strict_masks

    _interpreter.install()
    _strict_masks.install()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter computes bf16 tl.dot wrongly (seen with triton 3.6-3.7): bf16 runs on GPU only.
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]

warnings.filterwarnings("ignore", message="Conversion of an array with ndim > 0", category=DeprecationWarning)


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, help="i/n: run the i-th of n interleaved slices of the tests "
                     "(parallel processes on one GPU compile kernels concurrently)")


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        keep = [item for j, item in enumerate(items) if j % n == i]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With FA_BACKEND_TEST_DONE=FILE, append each finished test's node id to FILE (its call, or a setup that
    skipped or failed): what a shard cut by a time limit ran, so that scripts/gpu_check.sh tests_rest runs the rest."""
    path = os.environ.get("FA_BACKEND_TEST_DONE")
    if path and (report.when == "call" or (report.when == "setup" and not report.passed)):
        with open(path, "a") as f:
            f.write(report.nodeid + "\n")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def poisoned(monkeypatch):
    """Fill kernel outputs with NaN before each launch so unwritten elements fail the test."""
    from fa_backend.kernels.triton import _launch

    monkeypatch.setattr(_launch, "POISON_OUTPUTS", True)


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True, warn_only=True) for the test, the previous setting restored after."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("FA_BACKEND_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed} (replay with FA_BACKEND_TEST_SEED={seed})")
    torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def _gpu_memory_lock(request):
    """Tests marked gpu_memory run one at a time across the processes that share a GPU (scripts/gpu_check.sh runs
    eleven shards): their float64 references hold tens of GiB each (fifty-first session: three varlen tests of
    different shards overlapped and ran out of memory on an 80 GB H100)."""
    if request.node.get_closest_marker("gpu_memory") is None or not torch.cuda.is_available():
        yield
        return
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "fa_backend_gpu_memory.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.empty_cache()  # before the next holder starts
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Give cached GPU memory back after each test: several shards share one GPU, and each process's
    caching allocator would otherwise keep its own peak."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
