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
  * CUDA tensors: on the GPU, in a link stream of its own. After the collective the link stream
    runs a sleep kernel (``torch.cuda._sleep``, one thread) of the transfer's length, and the wait
    makes the caller's stream wait for it; no host synchronisation. A host-side booking cannot be
    used here: the host runs ahead of the GPU, so it would start a transfer before the GPU had
    produced its data and count the link against work still queued. One stream in order is the
    serial link, and a transfer starts when its data is (the collective waits for the caller's
    stream). The sleep's clock rate is measured once per device.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

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
        self._link_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the link (CUDA)

    def _start(self, collective, *args, **kwargs) -> Callable[[], None]:
        """Start the exchange (its second argument is what this rank sends), then book it on the
        link; the returned wait also waits for the link."""
        wait = super()._start(collective, *args, **kwargs)
        sent = args[1]
        seconds = sent.numel() * sent.element_size() * self.seconds_per_byte
        self.bytes_sent += sent.numel() * sent.element_size()
        if sent.is_cuda and seconds > 0:
            return self._on_link_stream(wait, seconds, sent.device)
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
                        device: torch.device) -> Callable[[], None]:
        """Queue the transfer's time on the device's link stream after the collective; the wait
        makes the caller's stream wait for it (no host synchronisation)."""
        link = self._link_streams.get(device.index)
        if link is None:
            link = self._link_streams[device.index] = torch.cuda.Stream(device)
        with torch.cuda.stream(link):
            wait()  # the collective's work: the link stream waits for it
            torch.cuda._sleep(max(1, round(seconds * _sleep_cycles_per_second(device.index))))
            done = torch.cuda.Event()
            done.record(link)

        def wait_for_link() -> None:
            torch.cuda.current_stream(device).wait_event(done)

        return wait_for_link


@functools.cache
def _sleep_cycles_per_second(device_index: int) -> float:
    """torch.cuda._sleep's cycles per second on the device, timed with CUDA events (the median
    of five sleeps of about 2 ms each at 1.5 GHz)."""
    cycles, rates = 3_000_000, []
    with torch.cuda.device(device_index):
        torch.cuda._sleep(cycles)  # warm-up: the kernel's first launch loads it
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / (start.elapsed_time(end) * 1e-3))
    return statistics.median(rates)
