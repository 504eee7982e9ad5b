"""Synchronous torch.distributed collectives that return once the backend has let go of the tensors.

gloo runs a collective on one of its worker threads. The caller's ``wait()`` returns as soon as
the worker marks the work complete, but the worker drops its own references to the work's tensors
a moment later. If Python has dropped its references first (a temporary passed to the
collective), the tensor's Python object is now owned by the work, and the worker must take the
GIL to free it. When that happens while the interpreter is finalizing (the collective was near
the end of a script), Python ends the worker thread with ``pthread_exit`` inside the work's
destructor, a ``noexcept`` frame, and the process aborts: "terminate called without an active
exception", exit status 134. On a loaded machine the worker often runs late (a quarter of the
calls return before it lets go), so a script that ends with an exchange aborts now and then.

``run_collective`` passes the collective fresh aliases of the tensors (same storage, a reference
count this module alone holds) and, for CPU tensors, waits until the backend's references are
gone: the worker then frees nothing that needs the GIL, and nothing of the call is left on the
worker when the caller moves on. CUDA tensors (NCCL) are not waited for: NCCL's watchdog holds a
work until the device finishes it, and waiting would synchronise the host with the device.

torch is imported here; ``vllm_moe_fixes.distributed`` does not import this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

# How long run_collective waits for a backend to drop its references before it returns anyway.
# gloo drops them within microseconds of being scheduled; the bound only guards against a
# backend that keeps them (the result is complete either way).
RELEASE_TIMEOUT_S = 10.0


def run_collective(collective: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
    """Call ``collective(*args, **kwargs)``, a synchronous collective such as
    ``dist.all_to_all_single`` or ``dist.all_reduce``, and return once the backend holds none of
    the CPU tensors among ``args``.

    Arguments:
        collective: a torch.distributed collective called without ``async_op`` (it has completed
            when it returns).
        *args: its positional arguments; with a CPU tensor among them, each tensor (any shape
            and dtype) is passed as an alias (``tensor.detach()``: the same storage, written in
            place as usual); CUDA tensors alone are passed as they are.
        **kwargs: its keyword arguments (``group=``, ``op=``...), passed unchanged.
    """
    if not any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
        collective(*args, **kwargs)  # nothing to wait for: no aliases needed (host work per call)
        return
    aliases = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    collective(*aliases, **kwargs)
    cpu = [a for a in aliases if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    # An alias's use count is 1 when only this function refers to it.
    while any(a._use_count() > 1 for a in cpu) and time.monotonic() < deadline:
        time.sleep(0)  # releases the GIL; the worker needs none to drop these references
