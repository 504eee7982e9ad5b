"""Peak device memory of a block of code, for the benchmarks, the GPU tests and the CLI.

    with peak_memory(device) as peak:
        out = layer(x)
    peak.bytes  # the most bytes allocated at once inside the block beyond what was already held

Counts the caching allocator's allocated bytes (`torch.cuda.max_memory_allocated`), not what it
reserves, so cached free blocks neither add to nor hide a peak. Tensors created in the block and
still alive at its end count too (they are part of the peak). The peak statistic is reset on
entry, so blocks may not be nested.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class PeakMemory:
    """Result of `peak_memory`: `bytes` is None until the block ends, and stays None on a
    non-CUDA device (the CPU allocator keeps no peak statistic)."""

    bytes: int | None = None


@contextlib.contextmanager
def peak_memory(device: torch.device | str | int | None = None) -> Iterator[PeakMemory]:
    """Measure the extra peak allocated memory of the `with` block on `device`.

    Arguments:
        device: a CUDA device (torch.device, "cuda:1", an index, or None for the current one);
            any other device type measures nothing.

    Returns (as the context value):
        a PeakMemory whose `bytes`, set when the block ends, is
        max_memory_allocated(device) during the block - memory_allocated(device) on entry.
        Both are read after a device synchronize, so blocks whose free waits on queued work of
        another stream (record_stream) are settled before they are counted.
    """
    result = PeakMemory()
    if device is not None and not isinstance(device, int) and torch.device(device).type != "cuda":
        yield result
        return
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield result
    torch.cuda.synchronize(device)
    result.bytes = torch.cuda.max_memory_allocated(device) - base
