"""FP8 block quantisation: the constants and the scale layout every kernel and layer shares.

Activations are quantised per 1x128 group of channels (one float32 scale per token and group),
weights per 128x128 block. DeepGEMM's SM90 kernels read activation scales MN-major: for scales of
logical shape [..., rows, groups] the rows are contiguous (strides (1, rows_padded) in the last two
dimensions), with rows_padded a multiple of 4 so that every group's column starts on a 16-byte
boundary, as the tensor-memory accelerator requires. `empty_mn_major_scales` allocates that layout.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BLOCK = 128  # channels per activation scale group; side of a weight scale block

# float32 scales per 16 bytes: the row padding of the MN-major (TMA-aligned) layout.
_TMA_ALIGN_ROWS = 16 // 4


def align_up(n: int, alignment: int) -> int:
    """The smallest multiple of `alignment` that is >= n."""
    return (n + alignment - 1) // alignment * alignment


def tma_aligned_rows(rows: int) -> int:
    """Rows of the MN-major scale layout: `rows` rounded up to a multiple of 4 (16 bytes)."""
    return align_up(rows, _TMA_ALIGN_ROWS)


def empty_mn_major_scales(shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Uninitialised float32 scales of logical `shape` [..., rows, groups], MN-major and TMA-aligned:
    strides (..., 1, tma_aligned_rows(rows)) in the last two dimensions."""
    *batch, rows, groups = shape
    storage = torch.empty((*batch, groups, tma_aligned_rows(rows)), dtype=torch.float32,
                          device=device)
    return storage[..., :rows].transpose(-1, -2)
