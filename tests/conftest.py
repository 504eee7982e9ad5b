"""Test set-up: Triton's interpreter on machines without a GPU, and markers that skip cleanly.

Triton decides between compiling and interpreting when a kernel is decorated, so TRITON_INTERPRET
must be set before any module of the package is imported: that is why it is set here, first.
"""

import importlib.util
import os

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


@pytest.fixture
def kernel_device():
    """Device on which to run Triton launchers directly."""
    return KERNEL_DEVICE
