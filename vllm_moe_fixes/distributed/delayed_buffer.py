"""A TorchAll2AllBuffer on a simulated link, for measuring how much of the all-to-all an overlap
hides (benchmarks/bench_overlap.py) on machines whose real exchange is too fast to matter (gloo
on one host).

Every data exchange of the buffer (``TorchAll2AllBuffer._start``: the high-throughput rows and
combine, the low-latency slab and combine) takes ``seconds_per_byte`` times the bytes this rank
sends, on a serial link: a transfer begins when the previous one of this rank has ended, and its
wait returns no earlier than its end (``time.sleep`` for what is left: the host is free while a
transfer is under way, as with a real network). The count exchanges (a few bytes, synchronous)
are not delayed. Results are the plain buffer's, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer


class DelayedAll2AllBuffer(TorchAll2AllBuffer):
    """TorchAll2AllBuffer whose data exchanges take ``seconds_per_byte`` per byte sent.

    Arguments:
        group, low_latency_mode, ...: TorchAll2AllBuffer's (keywords passed on).
        seconds_per_byte: the simulated link's time per byte this rank sends (>= 0; 0: the plain
            buffer's timing).

    ``bytes_sent`` adds up the bytes of the data exchanges: their simulated time is bytes_sent *
    seconds_per_byte; ``waited_seconds`` adds up the time waits spent on the link (the simulated
    time the caller did not hide). Reset both between measurements.
    """

    def __init__(self, group=None, *, seconds_per_byte: float, **kwargs) -> None:
        if isinstance(seconds_per_byte, bool) or not isinstance(seconds_per_byte, (int, float)) \
                or not seconds_per_byte >= 0:
            raise ValueError(f"seconds_per_byte={seconds_per_byte!r} must be a number >= 0")
        super().__init__(group, **kwargs)
        self.seconds_per_byte = float(seconds_per_byte)
        self.bytes_sent = 0
        self.waited_seconds = 0.0
        self._link_free_at = 0.0  # time.perf_counter() when the last transfer ends

    def _start(self, collective, *args, **kwargs) -> Callable[[], None]:
        """Start the exchange (its second argument is what this rank sends), then book it on the
        link; the returned wait also waits for the booked end."""
        wait = super()._start(collective, *args, **kwargs)
        sent = args[1].numel() * args[1].element_size()
        self.bytes_sent += sent
        begin = max(time.perf_counter(), self._link_free_at)
        end = self._link_free_at = begin + sent * self.seconds_per_byte

        def wait_for_link() -> None:
            wait()
            left = end - time.perf_counter()
            if left > 0:
                self.waited_seconds += left
                time.sleep(left)

        return wait_for_link
