"""The experts' scratch memory: two grow-only buffers owned by the modular kernel, and the cache
of the views an experts implementation builds on them.

The kernel asks the experts for the shapes they need (`Experts.workspace_shapes`) and hands them
views of the two buffers (`Workspaces.get`); the experts carve their own tensors out of those views
once per shape (`views_cached_on`). A second call with the same or a smaller problem allocates
nothing.
"""

from __future__ import annotations

import math

import torch


class Workspaces:
    """Two grow-only bf16 buffers (per device), shareable by the kernels of several layers.

    `get` returns the same view objects for the same request (the latest _MAX_VIEWS requests are
    remembered) until a buffer grows, so the experts may cache their own views on them.
    `generation` counts the buffers' replacements: a view obtained at one generation is one
    `get` would still return while the generation is unchanged.
    """

    _MAX_VIEWS = 64

    def __init__(self) -> None:
        self.ws13: torch.Tensor | None = None
        self.ws2: torch.Tensor | None = None
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.generation = 0
        self._partner: Workspaces | None = None

    def partner(self) -> Workspaces:
        """The second set a two-batch call's odd micro-batches use (a combine may still read the
        even one's output), made once and shared as this set is: layers that share these
        workspaces run one after another, so they share that set too."""
        if self._partner is None:
            self._partner = Workspaces()
        return self._partner

    def _get(self, name: str, numel: int, device: torch.device, dtype: torch.dtype):
        buf = getattr(self, name)
        if buf is None or buf.numel() < numel or buf.device != device or buf.dtype != dtype:
            self._views.clear()  # drop every view of the old buffer with it
            self.generation += 1
            setattr(self, name, None)  # free the old buffer before allocating the larger one
            with torch.inference_mode(False):  # see views_cached_on
                buf = torch.empty(numel, dtype=dtype, device=device)
            setattr(self, name, buf)
        return buf

    def get(self, ws13_shape, ws2_shape, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the requested shapes, growing a buffer when it is too small."""
        key = (ws13_shape, ws2_shape, device, dtype)
        views = self._views.get(key)
        if views is not None:
            return views
        n13, n2 = math.prod(ws13_shape), math.prod(ws2_shape)
        buf13 = self._get("ws13", n13, _as_tensors_report(device), dtype)
        buf2 = self._get("ws2", n2, _as_tensors_report(device), dtype)
        if len(self._views) >= self._MAX_VIEWS:
            del self._views[next(iter(self._views))]  # the oldest request
        views = self._views[key] = (buf13[:n13].view(ws13_shape), buf2[:n2].view(ws2_shape))
        return views


def _as_tensors_report(device) -> torch.device:
    """device as a tensor on it reports it (tensor.device, what _get compares the buffers'
    with): a torch.device, and the current CUDA device for "cuda" without an index. A request
    for "cuda" or "cpu" as a string or an unindexed device would otherwise replace the buffers
    every time."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def views_cached_on(ws13: torch.Tensor, ws2: torch.Tensor, make, *sizes):
    """``make(ws13, ws2, *sizes)``, cached in a dict attached to ws2 itself: the kernel hands the
    same workspace view objects to every call of a shape until a buffer grows, so an experts'
    views built on them live exactly as long as those (never past a workspace that grew).

    The buffers and these views are made outside torch.inference_mode even when the first call
    runs inside it: a tensor made there (a dtype view too) cannot be written outside it, so one
    call under inference mode would break every later call without it. (Under torch.compile the
    experts run as one custom op, fused_moe/interfaces.py: this runs eagerly inside it.)"""
    cache = ws2.__dict__.setdefault("_views_of", {})
    key = (make, ws13.data_ptr(), ws2.data_ptr(), *sizes)
    views = cache.get(key)
    if views is None:
        with torch.inference_mode(False):
            views = cache[key] = make(ws13, ws2, *sizes)
    return views
