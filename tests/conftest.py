"""Test-suite switches.

On a machine without a GPU the kernels run in Pallas interpret mode (the library picks it). On a
GPU they run compiled; pass ``--compiled`` (or set PALLAS_FLASH_COMPILED=1) to insist on that, so
a GPU run cannot silently fall back to the interpreter.
"""

import os

# Four CPU devices for the sharding and ring-attention tests. XLA reads this once, when JAX
# initialises its CPU backend, so it must be set before the first `import jax`. It changes
# nothing on a GPU, and single-device tests keep using device 0.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()

# Without a GPU plugin every kernel here runs interpreted, as XLA:CPU programs compiled once and
# run on tiny shapes: LLVM's optimisation of them costs more time than it saves. A GPU
# machine keeps XLA's default.
def _gpu_plugin_installed():
    from importlib import metadata
    names = ((d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions())
    return any(n.startswith(("jax-cuda", "jax-rocm")) for n in names)


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and \
        not _gpu_plugin_installed():
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# GPU interpret mode (the Mosaic kernels on the CPU) can hang when XLA:CPU's intra-op pool has
# too few threads for a CTA's warpgroups (pallas_flash.mosaic.common.interpret_params says why).
# The pool is sized by NPROC, else the core count, and read once, when JAX initialises; the
# floor leaves room for the kernel's own callback and for independent kernels of one program.
# Elsewhere it only lets XLA split work over more threads than cores.
_MIN_CPU_POOL = 16
_cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
          else os.cpu_count() or 1)
if not {"NPROC", "PORTABLE_NPROC"} & set(os.environ) and _cores < _MIN_CPU_POOL:
    os.environ["NPROC"] = str(_MIN_CPU_POOL)

# PALLAS_FLASH_SPREAD_GPUS=N (a machine with N GPUs, under pytest-xdist): each worker sees one
# GPU, worker i the (i mod N)-th, so the single-device tests spread over all of them instead of
# queueing on GPU 0. Also read before JAX initialises. Multi-device tests need it unset.
_spread = os.environ.get("PALLAS_FLASH_SPREAD_GPUS")
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _spread and _worker.startswith("gw"):
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % int(_spread))

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--compiled", action="store_true", default=False,
                     help="require a GPU and run the kernels compiled (not interpreted)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: large shapes; deselect with -m 'not slow'")
    compiled = config.getoption("--compiled") or os.environ.get("PALLAS_FLASH_COMPILED") == "1"
    if compiled and jax.default_backend() != "gpu":
        raise pytest.UsageError("--compiled needs a GPU, but JAX's default backend is "
                                f"{jax.default_backend()!r}")


def pytest_runtest_logreport(report):
    """PALLAS_FLASH_TEST_TIMES=PATH: each test phase's seconds appended to PATH as it ends
    (seconds, phase, outcome, test id; tab-separated), so a run cut by its time limit still
    shows where its time went. Under pytest-xdist the controller writes every worker's."""
    path = os.environ.get("PALLAS_FLASH_TEST_TIMES")
    if path and not _worker:   # a worker's reports reach the controller too
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records every flash_attention call pf.dot_product_attention makes (its kernel path)."""
    import pallas_flash as pf
    from pallas_flash import nn as pf_nn

    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return pf.flash_attention(*args, **kwargs)

    monkeypatch.setattr(pf_nn, "flash_attention", spy)
    return calls
