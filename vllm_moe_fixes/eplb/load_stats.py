"""Per-layer, per-logical-expert token counts over a sliding window of steps, kept on the device.

    counts  int64 [window, num_layers, E + 1]     (column E counts the -1 ids and is not read)
                   ^ position: a device scalar; record() adds into counts[position, layer]

``record`` (inside the layer call) adds one to ``counts[position, layer, id]`` for every
(token, slot) id with one scatter_add at a flat index computed on the device; ``step`` (once per
engine step, after the layers) moves the position on and clears the slot it lands on. Neither
reads a value on the host, so both can run inside a CUDA graph. ``window_load`` sums the window.
The counts are this rank's tokens; a rebalance sums them over the ranks (``group_load``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm_moe_fixes._validate import check, check_positive_int
from vllm_moe_fixes.distributed.collectives import run_collective

__all__ = ["ExpertLoadStats"]


class ExpertLoadStats:
    """Token counts per layer and logical expert over the last ``window`` steps.

    Args:
        num_layers: MoE layers recorded (layer indices 0..num_layers-1).
        num_logical: E, logical experts per layer.
        window: steps kept; ``step`` drops the oldest.
        device: where the counts live (the layers' device).
    """

    def __init__(self, num_layers: int, num_logical: int, window: int,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("num_logical", num_logical),
                            ("window", window)):
            check_positive_int(name, value)
        self.num_layers, self.num_logical, self.window = num_layers, num_logical, window
        self.counts = torch.zeros(window, num_layers, num_logical + 1, dtype=torch.int64,
                                  device=device)
        self.position = torch.zeros((), dtype=torch.int64, device=device)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add `topk_ids` (`[num_tokens, topk]`, integer, logical ids in [0, E) or -1; not
        checked on the device) to `layer`'s counts at the current position."""
        check(isinstance(layer, int) and 0 <= layer < self.num_layers,
              f"layer={layer!r} must be an int in [0, num_layers={self.num_layers})")
        ids = topk_ids.reshape(-1).long()
        ids = torch.where(ids >= 0, ids, self.num_logical)
        row = (self.position * self.num_layers + layer) * (self.num_logical + 1)
        self.counts.view(-1).scatter_add_(0, row + ids, torch.ones_like(ids))

    def step(self) -> None:
        """Move to the next position of the window and clear it (device ops only)."""
        self.position.add_(1).remainder_(self.window)
        self.counts.index_fill_(0, self.position.view(1), 0)

    def window_load(self) -> torch.Tensor:
        """int64 `[num_layers, E]`: each layer's counts summed over the window."""
        return self.counts[..., :self.num_logical].sum(0)

    def load(self, layer: int) -> torch.Tensor:
        """int64 `[E]`: `layer`'s counts summed over the window."""
        check(isinstance(layer, int) and 0 <= layer < self.num_layers,
              f"layer={layer!r} must be an int in [0, num_layers={self.num_layers})")
        return self.counts[:, layer, :self.num_logical].sum(0)

    def group_load(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """int64 `[num_layers, E]`: ``window_load`` summed over the ranks of `group` (an
        all-reduce; every rank of the group calls it)."""
        load = self.window_load()
        run_collective(dist.all_reduce, load, group=group)
        return load

    def reset(self) -> None:
        """Clear every count (after a rebalance, the old placement's window says nothing)."""
        self.counts.zero_()
