"""FP8 block quantisation: the constants and the scale layout every kernel and layer shares.

Activations are quantised per 1x128 group of channels (one float32 scale per token and group),
weights per 128x128 block. DeepGEMM's SM90 kernels read activation scales MN-major: for scales of
logical shape [..., rows, groups] the rows are contiguous (strides (1, rows_padded) in the last two
dimensions), with rows_padded a multiple of 4 so that every group's column starts on a 16-byte
boundary, as the tensor-memory accelerator requires. `empty_mn_major_scales` allocates that layout
(or, unpadded, DeepEP's low-latency one); `mn_major_scales_view` lays it over a workspace.
A block-quantised weight stands for its values times its block's scale: `dequant_block_fp8`.
"""

from __future__ import annotations

import math

import torch

# Channels per activation scale group; side of a weight scale block. Plain Python in sizes.py, so
# that the torch-free planner sizes with the same number.
from vllm_moe_fixes.sizes import SCALE_BLOCK, align_up

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# float32 scales per 16 bytes: the row padding of the MN-major (TMA-aligned) layout.
_TMA_ALIGN_ROWS = 16 // 4


def tma_aligned_rows(rows: int) -> int:
    """Rows of the MN-major scale layout: `rows` rounded up to a multiple of 4 (16 bytes)."""
    return align_up(rows, _TMA_ALIGN_ROWS)


def empty_mn_major_scales(shape: tuple[int, ...], device: torch.device | str,
                          tma_aligned: bool = True) -> torch.Tensor:
    """Uninitialised float32 scales of logical `shape` [..., rows, groups], MN-major: strides
    (..., 1, tma_aligned_rows(rows)) in the last two dimensions, or (..., 1, rows) when not
    `tma_aligned` (DeepEP's low-latency layout, [E, T, groups] with strides (groups*T, 1, T))."""
    *batch, rows, groups = shape
    padded = tma_aligned_rows(rows) if tma_aligned else rows
    # One allocation with the final strides (storage [..., groups, padded], every column padded
    # to the end); a slice only where padding rows exist. Fewer host calls than allocating the
    # storage shape and transposing it (small-M quant pays this on every call).
    strides = [1, padded]
    step = groups * padded
    for size in reversed(batch):
        strides.insert(0, step)
        step *= size
    scales = torch.empty_strided((*batch, padded, groups), strides, dtype=torch.float32,
                                 device=device)
    return scales if padded == rows else scales[..., :rows, :]


def mn_major_scales_view(ws: torch.Tensor, byte_offset: int,
                         shape: tuple[int, ...]) -> torch.Tensor:
    """float32 scales of logical `shape` [..., rows, groups], MN-major without padding (strides
    (..., 1, rows)), over the bytes of the contiguous workspace `ws` (any dtype) from
    `byte_offset` on. TMA needs byte_offset a multiple of 16 and rows a multiple of 4."""
    *batch, rows, groups = shape
    nbytes = 4 * math.prod(shape)
    flat = ws.view(-1).view(torch.uint8)[byte_offset:byte_offset + nbytes].view(torch.float32)
    return flat.view(*batch, groups, rows).transpose(-1, -2)


def dequant_block_fp8(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., R, C] with float32 [..., cdiv(R,128), cdiv(C,128)] block scales
    -> float32 [..., R, C] = w * its 128x128 block's scale."""
    R, C = w.shape[-2:]
    s = w_scale.float().repeat_interleave(SCALE_BLOCK, dim=-2)[..., :R, :]
    s = s.repeat_interleave(SCALE_BLOCK, dim=-1)[..., :C]
    return w.float() * s
