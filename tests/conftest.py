"""Test set-up: Triton's interpreter on machines without a GPU, markers that skip cleanly, and a
GPU selection (``-m "gpu or multi_gpu"``) that fails where none of its tests ran.

Triton decides between compiling and interpreting when a kernel is decorated, so TRITON_INTERPRET
must be set before any module of the package is imported: that is why it is set here, first.
"""

import importlib.util
import os
import re

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Tensors for the Triton launchers: CUDA on a GPU machine, CPU under the interpreter elsewhere.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"

_SKIPS = {
    "gpu": (not HAS_CUDA, "needs a CUDA GPU"),
    "multi_gpu": (not HAS_CUDA or torch.cuda.device_count() < 2, "needs two or more CUDA GPUs"),
    "deep_ep": (importlib.util.find_spec("deep_ep") is None, "deep_ep is not installed"),
    "deep_gemm": (importlib.util.find_spec("deep_gemm") is None, "deep_gemm is not installed"),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, (skip, why) in _SKIPS.items():
            if skip and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))


# A -m expression made only of these markers (no "not") selects GPU tests: a run of it in which no
# test passed ran nothing it was asked for (on a machine without a GPU, say), which pytest alone
# reports as success (exit 0, everything skipped).
_GPU_MARKERS = {"gpu", "multi_gpu", "deep_ep", "deep_gemm"}
_passed = []


def _selects_gpu_tests_only(markexpr: str) -> bool:
    words = set(re.findall(r"\w+", markexpr)) - {"and", "or"}
    return bool(words) and words <= _GPU_MARKERS


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _passed.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    markexpr = session.config.getoption("markexpr")
    if exitstatus == 0 and not _passed and _selects_gpu_tests_only(markexpr):
        print(f"\nno test of -m {markexpr!r} ran (every selected test skipped, or none was "
              "selected: no CUDA GPU or library here?); failing the run, exit status 5")
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


@pytest.fixture
def kernel_device():
    """Device on which to run Triton launchers directly."""
    return KERNEL_DEVICE
