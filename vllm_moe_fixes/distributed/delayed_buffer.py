"""A TorchAll2AllBuffer on a simulated link, for measuring how much of the all-to-all an overlap
hides (benchmarks/bench_overlap.py) on machines whose real exchange is too fast to matter (gloo
on one host, NCCL at world 1).

Every data exchange of the buffer (``TorchAll2AllBuffer._start``: the high-throughput rows and
combine, the low-latency slab and combine) takes ``seconds_per_byte`` times the bytes this rank
sends, on a serial link: a transfer begins when the previous one of this rank has ended and its
data is ready, and its wait returns no earlier than its end. The count exchanges (a few bytes,
synchronous) are not delayed. Results are the plain buffer's, bit for bit.

Where the link's time is spent:
  * CPU tensors: on the host. The transfer is booked at its start; its wait sleeps for what is
    left (``time.sleep``: the host is free meanwhile, as with a real network).
  * CUDA tensors: on the GPU, on a link stream of its own, as a host-to-device copy of pinned
    memory sized to take the transfer's time (the copy engine's measured rate, once per device);
    the wait makes the caller's stream wait for it, with no host synchronisation. One stream in
    order is the serial link, and a transfer starts when its data is ready (after the
    collective, which waits for the caller's stream). Not a host-side booking: the host runs
    ahead of the GPU, so it would start a transfer before its data existed and count the link
    against work still queued. Not a sleep kernel: it takes an SM, and a persistent GEMM that
    holds every SM (DeepGEMM's) would wait for it or keep it waiting. A copy takes no SM and
    a few per cent of the memory bandwidth.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer


class DelayedAll2AllBuffer(TorchAll2AllBuffer):
    """TorchAll2AllBuffer whose data exchanges take ``seconds_per_byte`` per byte sent.

    Arguments:
        group, low_latency_mode, ...: TorchAll2AllBuffer's (keywords passed on).
        seconds_per_byte: the simulated link's time per byte this rank sends (>= 0; 0: the plain
            buffer's timing).

    ``bytes_sent`` adds up the bytes of the data exchanges: their simulated time is bytes_sent *
    seconds_per_byte; ``waited_seconds`` adds up the time waits spent on the link (the simulated
    time the caller did not hide; CPU tensors only: on CUDA the link's time is spent on the GPU,
    time it with CUDA events). Reset both between measurements.
    """

    def __init__(self, group=None, *, seconds_per_byte: float, **kwargs) -> None:
        if isinstance(seconds_per_byte, bool) or not isinstance(seconds_per_byte, (int, float)) \
                or not seconds_per_byte >= 0:
            raise ValueError(f"seconds_per_byte={seconds_per_byte!r} must be a number >= 0")
        super().__init__(group, **kwargs)
        self.seconds_per_byte = float(seconds_per_byte)
        self.bytes_sent = 0
        self.waited_seconds = 0.0
        self._link_free_at = 0.0  # time.perf_counter() when the last transfer ends (CPU)
        self._links: dict[int, _Link] = {}  # device index -> its link (CUDA tensors)

    def _start(self, collective, *args, **kwargs) -> Callable[[], None]:
        """Start the exchange (its second argument is what this rank sends), then book it on the
        link; the returned wait also waits for the link."""
        wait = super()._start(collective, *args, **kwargs)
        sent = args[1]
        nbytes = sent.numel() * sent.element_size()
        self.bytes_sent += nbytes
        seconds = nbytes * self.seconds_per_byte
        if sent.is_cuda and seconds > 0:
            return self._on_link_stream(wait, seconds, args)
        return self._on_host(wait, seconds)

    def _on_host(self, wait: Callable[[], None], seconds: float) -> Callable[[], None]:
        """Book the transfer from now (or the link's last end) and wait it out on the host."""
        begin = max(time.perf_counter(), self._link_free_at)
        end = self._link_free_at = begin + seconds

        def wait_for_link() -> None:
            wait()
            left = end - time.perf_counter()
            if left > 0:
                self.waited_seconds += left
                time.sleep(left)

        return wait_for_link

    def _on_link_stream(self, wait: Callable[[], None], seconds: float,
                        tensors: tuple) -> Callable[[], None]:
        """Queue the transfer's time on the device's link stream after the collective; the wait
        makes the caller's stream wait for it (no host synchronisation). ``tensors`` (the
        collective's) are kept until then: the collective's work lets them go once the link
        stream has waited for it, and the caller's stream may reuse their memory only after its
        own wait."""
        device = tensors[1].device
        link = self._links.get(device.index)
        if link is None:
            link = self._links[device.index] = _Link.on(device)
        done = torch.cuda.Event()
        with torch.cuda.stream(link.stream):
            wait()  # the link stream waits for the collective
            link.take(seconds)
            done.record(link.stream)

        def wait_for_link() -> None:
            nonlocal tensors
            torch.cuda.current_stream(device).wait_event(done)
            tensors = None

        return wait_for_link


class _Link(NamedTuple):
    """A device's simulated link: its stream and the buffers its copies move."""

    stream: torch.cuda.Stream
    source: torch.Tensor  # uint8 [LINK_COPY_BYTES], pinned host memory
    target: torch.Tensor  # uint8 [LINK_COPY_BYTES] on the device

    @staticmethod
    def on(device: torch.device) -> _Link:
        return _Link(torch.cuda.Stream(device), *_copy_buffers(device))

    def take(self, seconds: float) -> None:
        """Queue copies on the current stream that take about ``seconds``."""
        rate, latency = _copy_rate(self.target.device.index)
        left = round(max(0.0, seconds - latency) * rate)
        while left > 0:  # a transfer longer than the buffers copies them again
            n = min(left, LINK_COPY_BYTES)
            self.target[:n].copy_(self.source[:n], non_blocking=True)
            left -= n


# The link's copy buffers: about 1 ms of a host-to-device copy at 50 GB/s (PCIe 5).
LINK_COPY_BYTES = 64 << 20


def _copy_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pinned host, device) uint8 buffers of LINK_COPY_BYTES."""
    return (torch.empty(LINK_COPY_BYTES, dtype=torch.uint8, pin_memory=True),
            torch.empty(LINK_COPY_BYTES, dtype=torch.uint8, device=device))


@functools.cache
def _copy_rate(device_index: int) -> tuple[float, float]:
    """(bytes per second, seconds of latency) of a host-to-device copy from pinned memory: a line
    through the medians of three copies of a sixteenth and of all of LINK_COPY_BYTES, timed with
    CUDA events on the current stream."""
    host, device = _copy_buffers(torch.device("cuda", device_index))

    def seconds(n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device[:n].copy_(host[:n], non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    seconds(LINK_COPY_BYTES)  # warm-up
    small, large = LINK_COPY_BYTES // 16, LINK_COPY_BYTES
    t_small = statistics.median(seconds(small) for _ in range(3))
    t_large = statistics.median(seconds(large) for _ in range(3))
    rate = (large - small) / (t_large - t_small)
    return rate, max(0.0, t_small - small / rate)
