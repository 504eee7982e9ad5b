"""The contiguous grouped FP8 GEMM as a Gluon kernel for Hopper (sm_90).

Same contract as `grouped_gemm.grouped_fp8_gemm_contiguous` (a_q/a_s 1x128 scales, w_q/w_s
128x128 scales, m_indices with -1 padding rows written as zeros, segments at multiples of
ROW_ALIGNMENT). Where the Triton kernel's `tl.dot` must finish each 128-wide K block before its
float32 promotion, the Gluon kernel issues the next block's wgmma asynchronously and promotes the
previous block meanwhile, with a TMA + mbarrier ring feeding shared memory
(_grouped_gemm_gluon_kernel.py draws the loop).

`grouped_gemm.grouped_fp8_gemm_contiguous` runs it on CUDA tensors when `use_gluon` says so:
ENABLED (off until an H200 run shows it faster than the Triton kernel), an sm_90 GPU, a Triton
with Hopper Gluon (`gluon_available`), and operands TMA can describe. Gluon is imported only when
a kernel is launched, so this module imports without it (CPU, the interpreter, other GPUs).
"""

from __future__ import annotations

import functools

import torch

from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK
from vllm_moe_fixes.sizes import cdiv

# Whether grouped_fp8_gemm_contiguous takes this kernel where use_gluon allows: the one switch,
# set once benchmarks/device_gluon_gemm.sh has measured it faster than the Triton kernel.
ENABLED = False

# The config keys are the Triton kernel's (grouped_gemm.DEFAULT_CONFIG), so that
# grouped_gemm.contiguous_config resolves GROUP_M per expert size and IMPRECISE_ACC per K for
# both. num_stages is the TMA ring's depth; IMPRECISE_ACC (0 = 128, or 64 / 32) is the K extent
# of one wgmma chain between float32 promotions; WARP_SPECIALIZE gives the TMA loads a producer
# warp of their own, released slot by slot through "empty" barriers (DeepGEMM's split).
# 128x128 with 8 warps (two warpgroups of 64 rows) is DeepGEMM's tile on these shapes.
GLUON_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4)


@functools.cache
def _gluon_api() -> bool:
    """Whether this Triton has the Hopper Gluon names the kernel uses."""
    try:
        from triton.experimental.gluon.language.nvidia import hopper
    except ImportError:
        return False
    tma_load = hasattr(hopper.tma, "async_load") or hasattr(hopper.tma,
                                                            "async_copy_global_to_shared")
    return tma_load and all(hasattr(hopper, name) for name in (
        "warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "mbarrier"))


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def gluon_available(device: torch.device | str | None = None) -> bool:
    """Whether the Gluon kernel can run on `device` (default: the current CUDA device): a
    visible sm_90 GPU and a Triton with Hopper Gluon."""
    if not torch.cuda.is_available():
        return False
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return _sm90(index) and _gluon_api()


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned base and row stride, as a TMA descriptor needs."""
    return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def use_gluon(a_q: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether grouped_fp8_gemm_contiguous runs this kernel for these (validated) operands."""
    return (ENABLED and a_q.is_cuda and w_q.numel() > 0 and _aligned(a_q) and _aligned(w_q)
            and gluon_available(a_q.device))


def check_config(cfg: dict) -> dict:
    """cfg (resolved by grouped_gemm.contiguous_config) if the Gluon kernel can run it."""
    if cfg["BLOCK_M"] not in (64, 128) or cfg["BLOCK_N"] not in (64, 128):
        raise ValueError(f"config: the Gluon kernel takes BLOCK_M and BLOCK_N 64 or 128, got "
                         f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}")
    if cfg["num_warps"] not in (4, 8):
        raise ValueError(f"config: the Gluon kernel takes num_warps 4 or 8, got {cfg['num_warps']}")
    if cfg["num_stages"] < 2:
        raise ValueError(f"config: num_stages must be >= 2, got {cfg['num_stages']}")
    return cfg


@functools.cache
def _kernel():
    from vllm_moe_fixes.ops import _grouped_gemm_gluon_kernel
    return _grouped_gemm_gluon_kernel.contiguous_kernel


@functools.cache
def _layouts(block_m: int, block_n: int, block_k: int, num_warps: int):
    """(A tile, W tile) shared layouts and the wgmma accumulator layout of a config."""
    from triton.experimental.gluon import language as gl
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.float8e4nv)
    # Warpgroups stack along M (64 rows each); 8 warps at BLOCK_M 64 split N in two.
    warps_m = min(num_warps, block_m // 16)
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, num_warps // warps_m],
                                    instr_shape=[16, block_n // (num_warps // warps_m), 32])
    return a_layout, w_layout, mma


def _descriptors(a_q, w_q, block_m, block_n, block_k, a_layout, w_layout):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    K = a_q.shape[1]
    return (TensorDescriptor.from_tensor(a_q, [block_m, block_k], a_layout),
            TensorDescriptor.from_tensor(w_q.view(-1, K), [block_n, block_k], w_layout))


def grouped_fp8_gemm_contiguous_gluon(a, w, out, m_indices, cfg: dict):
    """Gluon launcher of `grouped_fp8_gemm_contiguous` (same arguments, validated; operands
    that use_gluon accepts). cfg: a config resolved by grouped_gemm.contiguous_config from
    GLUON_CONFIG or another tile that check_config accepts."""
    (a_q, a_s), (w_q, w_s) = a, w
    M, K = a_q.shape
    N = w_q.shape[1]
    if M == 0:
        return out
    check_config(cfg)
    bm, bn, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]
    bk = cfg["IMPRECISE_ACC"] or SCALE_BLOCK
    a_layout, w_layout, mma = _layouts(bm, bn, bk, warps)
    a_desc, w_desc = _descriptors(a_q, w_q, bm, bn, bk, a_layout, w_layout)
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    _kernel()[grid](
        a_desc, w_desc, a_s, w_s, out, m_indices, M, N, K,
        *a_s.stride(), *w_s.stride(), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], STAGES=cfg["num_stages"],
        MMA=mma, WARP_SPECIALIZE=bool(cfg["WARP_SPECIALIZE"]), num_warps=warps)
    return out
