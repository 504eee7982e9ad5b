"""Grouped FP8 GEMMs with DeepGEMM's contracts: the Triton path when DeepGEMM is not installed.

Both GEMMs compute, for every row ``i`` routed to expert ``e``::

    out[i, :] = (a_q[i] * a_s[i]) @ (w_q[e] * w_s[e])^T          (bf16 result)

with activation scales per 1x128 group (``a_s[i, kb]``) and weight scales per 128x128 block
(``w_s[e, nb, kb]``). Because a scale is constant over one 128-wide K block, the kernel walks K in
blocks of 128 and promotes each block's FP8 tensor-core partial product to float32 before scaling::

    acc[m, n] += dot(a_q[m, kb-block], w_q[e, n, kb-block]) * a_s[m, kb] * w_s[e, n // 128, kb]

- contiguous layout (``grouped_fp8_gemm_contiguous``): rows of all experts stacked in one
  [M_sum, K] matrix, ``m_indices[i]`` naming the expert of row i (-1: padding, written as zeros).
  Each expert's rows start at a multiple of sizes.ROW_ALIGNMENT (128), so a BLOCK_M dividing it
  never holds two experts: its expert is the one of its first row, and a tile whose first row is
  -1 is all padding.
- masked layout (``grouped_fp8_gemm_masked``): a [E, T, K] batch, of which only the first
  ``masked_m[e]`` rows of expert e are computed; the rest of ``out[e]`` is left untouched.

CUDA tensors run the Triton kernel, CPU tensors the torch references defined here (the same sum,
with each block's dot products exact, so a row's result does not depend on the other rows).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK
from vllm_moe_fixes.sizes import cdiv


# ----------------------------------------------------------------------------------------------
# Block configuration
# ----------------------------------------------------------------------------------------------
# A config is a dict with the keys of DEFAULT_CONFIG: BLOCK_M, BLOCK_N (tile), GROUP_M (M tiles
# per L2 swizzle group), num_warps, num_stages, IMPRECISE_ACC, WARP_SPECIALIZE. BLOCK_K is
# SCALE_BLOCK (one scale per K block). BLOCK_M must divide ROW_ALIGNMENT = 128 (a tile never spans
# two experts' segments); BLOCK_N is a power of two up to 256 (a TMA box dimension; it then divides
# SCALE_BLOCK or is 256: a tile never splits a weight-scale block).
#
# IMPRECISE_ACC: how many K elements Hopper's FP8 tensor cores sum in their own accumulator (about
# 14 mantissa bits) before the partial sum is added in float32 (`tl.dot`'s max_num_imprecise_acc).
# 0 keeps Triton's default, a whole 128-wide scale block, which is what DeepGEMM does: the outputs
# then equal DeepGEMM's. 64 or 32 promote every wgmma pair or step: closer to the exact block
# product, at lower TFLOP/s (benchmarks/results/grouped_gemm_accuracy.json). Other GPUs and the
# interpreter accumulate in float32 throughout and ignore it. Where the caller names none, K >=
# PROMOTE_FROM_K promotes every PROMOTE_EVERY of K (`_promoted`): at K 7168 once per 128 leaves
# vLLM's block-FP8 fused-MoE test (scales rounded to powers of two, as with DeepGEMM on Hopper)
# above its tolerance, every 64 under it; GEMM2 (K = I, 2048 for DeepSeek) keeps the default's
# speed.
# WARP_SPECIALIZE (Triton's automatic producer / consumer partitions of the K loop) stays off: it
# halves the masked kernel's speed and gains nothing contiguous. Larger tiles (128x128, 64x256,
# 128x256, split or not) and loading the next K block's scales early are slower than the default
# on the bench shapes: the SM's other CTAs already hide the scales' load latency
# (benchmarks/results/grouped_gemm_config_h200.txt and grouped_gemm_sweep_h200.log hold the
# sweeps).
#
# A and W blocks are loaded through host TMA descriptors (A as [rows, K], W as [E*N, K]; rows
# past the end read as zeros, rows of a neighbouring expert are never stored). At 64x128 with 4
# warps the kernel needs 165 registers, so 3 CTAs share an SM at num_stages=3 (72 KiB of shared
# memory). Per-thread pointer loads remain only for operands a descriptor cannot describe (see
# _tma_views).
#
# Default: the best tile of the H200 sweep; the masked kernel shares the main loop and the TMA
# operand shapes, so it takes the same default.
DEFAULT_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=32, num_warps=4, num_stages=3,
                      IMPRECISE_ACC=0, WARP_SPECIALIZE=False)
# The contiguous kernel's swizzle groups run over the stacked rows of all experts, so with few rows
# an expert a group of 32 M tiles spans several experts, whose W tiles it cannot share (the masked
# grid has an axis per expert, so its groups never span two). Where the caller names no GROUP_M,
# the contiguous kernel therefore takes a group of about one expert's M tiles (rows // experts //
# BLOCK_M, down to a power of two, between _MIN_GROUP_M and DEFAULT_CONFIG's): the masked kernel's
# tile order for equal experts. Only the order changes, so the output bits do not.
_MIN_GROUP_M = 4
PROMOTE_FROM_K = 4096
PROMOTE_EVERY = 64


def default_config() -> dict:
    """Block config used when the caller passes none (a fresh copy of DEFAULT_CONFIG)."""
    return dict(DEFAULT_CONFIG)


def _resolve_config(config: dict | None) -> dict:
    cfg = default_config()
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; known: {sorted(cfg)}")
        cfg.update(config)
    if cfg["BLOCK_M"] not in (16, 32, 64, 128):
        raise ValueError(f"config: BLOCK_M must divide 128 (16/32/64/128), got {cfg['BLOCK_M']}")
    if cfg["BLOCK_N"] not in (16, 32, 64, 128, 256):
        raise ValueError(f"config: BLOCK_N must be 16/32/64/128/256, got {cfg['BLOCK_N']}")
    if cfg["IMPRECISE_ACC"] not in (0, 32, 64, 128):
        raise ValueError(f"config: IMPRECISE_ACC must be 0/32/64/128, got {cfg['IMPRECISE_ACC']}")
    return cfg


def _promoted(cfg: dict, config: dict | None, K: int) -> dict:
    """cfg promoting every PROMOTE_EVERY of K at K >= PROMOTE_FROM_K, unless config names its own
    IMPRECISE_ACC (0: Triton's default)."""
    if K >= PROMOTE_FROM_K and not (config and "IMPRECISE_ACC" in config):
        cfg["IMPRECISE_ACC"] = PROMOTE_EVERY
    return cfg


def masked_config(K: int, config: dict | None = None) -> dict:
    """The config the masked launcher runs at reduction size K: DEFAULT_CONFIG with `config`'s
    overrides, promoting at deep K unless IMPRECISE_ACC is given."""
    return _promoted(_resolve_config(config), config, K)


def contiguous_config(rows: int, experts: int, config: dict | None = None, K: int = 0) -> dict:
    """The config the contiguous launcher runs for `rows` stacked rows of `experts` experts at
    reduction size K: DEFAULT_CONFIG with `config`'s overrides, GROUP_M chosen per expert size
    unless given, promoting at deep K unless IMPRECISE_ACC is given."""
    cfg = _promoted(_resolve_config(config), config, K)
    if not (config and "GROUP_M" in config):
        tiles = max(rows // max(experts, 1) // cfg["BLOCK_M"], 1)
        cfg["GROUP_M"] = min(max(1 << (tiles.bit_length() - 1), _MIN_GROUP_M),
                             DEFAULT_CONFIG["GROUP_M"])
    return cfg


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    """16-byte aligned base and strides (bytes), as TMA requires."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in strides)


def _tma_views(a_q: torch.Tensor, w_q: torch.Tensor):
    """A as [rows, K] and W as [E*N, K] for TMA descriptors, or None when a descriptor cannot
    describe them. The public API accepts, and then loads through pointers:
    - an operand whose base address or row stride is not a multiple of 16 bytes (a view at an
      odd offset into a larger buffer; quantisers and workspaces never produce one),
    - a masked a_q whose experts are not at a uniform row stride (a_q[:, :T] of a longer batch):
      one 2-D descriptor cannot span them,
    - an empty w_q (E == 0; a descriptor needs positive sizes).
    """
    K = a_q.shape[-1]
    if a_q.dim() == 3:
        E, T = a_q.shape[:2]
        if E > 1 and a_q.stride(0) != T * a_q.stride(1):
            return None
        a_q = a_q.as_strided((E * T, K), (a_q.stride(1), 1))
    if w_q.numel() == 0 or not _aligned(w_q) or not _aligned(a_q, a_q.stride(0)):
        return None
    return a_q, w_q.view(-1, K)


# Descriptors of the last operand pairs, keyed by the operands' identities and the tile: the
# experts pass the same workspace views and weights every call, and building the two descriptors
# (with _tma_views' checks) costs several microseconds of host time per launch. An entry is used
# only while both operands are still those objects with the same data pointer, dtype, shape and
# strides; it is dropped when either operand is freed (a weakref callback), so it never keeps a
# buffer alive past its tensor.
_DESCRIPTORS: dict[tuple, tuple] = {}
# A model calls two GEMMs per MoE layer with its own weights (DeepSeek-V3: 58 layers, 116 pairs)
# for each workspace shape in use; past this many entries the oldest one goes.
_MAX_DESCRIPTORS = 1024


def _signature(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, t.shape, t.stride()


def _descriptors(cfg: dict, a_q: torch.Tensor, w_q: torch.Tensor) -> list:
    """[A descriptor, W descriptor] for TMA, or [None, None] when _tma_views refuses."""
    key = (id(a_q), id(w_q), cfg["BLOCK_M"], cfg["BLOCK_N"])
    signatures = (_signature(a_q), _signature(w_q))
    entry = _DESCRIPTORS.get(key)
    if entry is not None and entry[0]() is a_q and entry[1]() is w_q and \
            entry[2] == signatures:
        return entry[3]
    views = _tma_views(a_q, w_q)
    # The descriptors' base tensors are detached (not views: a view keeps its base's Python
    # object alive), so an entry refers to the operands only weakly.
    descs = [None, None] if views is None else [
        TensorDescriptor.from_tensor(views[0].detach(), [cfg["BLOCK_M"], SCALE_BLOCK]),
        TensorDescriptor.from_tensor(views[1].detach(), [cfg["BLOCK_N"], SCALE_BLOCK])]

    def drop(ref, key=key):
        held = _DESCRIPTORS.get(key)
        if held is not None and (held[0] is ref or held[1] is ref):
            del _DESCRIPTORS[key]

    if len(_DESCRIPTORS) >= _MAX_DESCRIPTORS:
        del _DESCRIPTORS[next(iter(_DESCRIPTORS))]
    _DESCRIPTORS[key] = (weakref.ref(a_q, drop), weakref.ref(w_q, drop), signatures, descs)
    return descs


def _launch_args(cfg: dict, a_q: torch.Tensor, w_q: torch.Tensor) -> tuple[list, dict]:
    """(descriptor arguments, keyword arguments) of a kernel launch: TMA when _tma_views allows."""
    descs = _descriptors(cfg, a_q, w_q)
    return descs, dict(cfg, BLOCK_K=SCALE_BLOCK, TMA=descs[0] is not None)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _swizzle(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Map a linear tile id to (m, n) so that GROUP_M consecutive M tiles share W tiles in L2."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _block_scaled_mma(a_ptr, a_s_ptr, w_ptr, w_s_ptr, rows, cols, K,
                      stride_am, stride_asm, stride_ask, stride_wn, stride_wsn, stride_wsk,
                      a_desc, w_desc, a_row, w_row,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      TMA: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
                      WARP_SPECIALIZE: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = sum over K blocks of dot(A_blk, W_blk^T) * a_s * w_s.

    `rows` / `cols` are int64 indices already clamped into range (no masks in the loop); scale
    offsets (kb * stride) stay 32-bit, as a_s has M*K/128 elements. With TMA, the blocks come
    from the descriptors at rows a_row (of A) / w_row (of W) and column k; otherwise through
    per-thread pointers. The W tile is used as [BLOCK_K, BLOCK_N] with K contiguous (K-major B),
    which Hopper's FP8 wgmma takes directly from shared memory.
    """
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None]
    a_s_ptrs = a_s_ptr + rows * stride_asm
    if BLOCK_N <= BLOCK_K:  # the tile lies inside one 128-column weight-scale block: one scalar
        w_s_ptrs = w_s_ptr + (tl.min(cols) // BLOCK_K) * stride_wsn
    else:
        w_s_ptrs = w_s_ptr + (cols // BLOCK_K) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, K // BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        if TMA:
            a = a_desc.load([a_row, kb * BLOCK_K])
            w = w_desc.load([w_row, kb * BLOCK_K]).T
        else:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if IMPRECISE_ACC == 0:
            part = tl.dot(a, w)
        else:
            part = tl.dot(a, w, max_num_imprecise_acc=IMPRECISE_ACC)
        a_s = tl.load(a_s_ptrs + kb * stride_ask)
        if BLOCK_N <= BLOCK_K:
            acc += part * (a_s * tl.load(w_s_ptrs + kb * stride_wsk))[:, None]
        else:
            acc += part * (a_s[:, None] * tl.load(w_s_ptrs + kb * stride_wsk)[None, :])
    return acc


@triton.jit
def _contiguous_kernel(a_ptr, a_s_ptr, w_ptr, w_s_ptr, out_ptr, m_idx_ptr, M, N, K,
                       stride_am, stride_asm, stride_ask,
                       stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_om,
                       a_desc, w_desc,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, TMA: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
                       WARP_SPECIALIZE: tl.constexpr):
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(m_idx_ptr + pid_m.to(tl.int64) * BLOCK_M)
    if expert >= 0:
        rows = tl.minimum(offs_m, M - 1)
        cols = tl.minimum(offs_n, N - 1)
        e = expert.to(tl.int64)
        acc = _block_scaled_mma(a_ptr, a_s_ptr, w_ptr + e * stride_we, w_s_ptr + e * stride_wse,
                                rows, cols, K, stride_am, stride_asm, stride_ask,
                                stride_wn, stride_wsn, stride_wsk, a_desc, w_desc,
                                pid_m * BLOCK_M, expert * N + pid_n * BLOCK_N,
                                BLOCK_M, BLOCK_N, BLOCK_K, TMA, IMPRECISE_ACC, WARP_SPECIALIZE)
        # Trailing -1 rows of the expert's last tile are padding: exact zeros.
        row_experts = tl.load(m_idx_ptr + offs_m, mask=offs_m < M, other=-1)
        acc = tl.where((row_experts == expert)[:, None], acc, 0.0)
    else:  # the whole tile is padding (segments start at multiples of 128)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Output addresses are formed after the K loop so they do not hold registers through it.
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _masked_kernel(a_ptr, a_s_ptr, w_ptr, w_s_ptr, out_ptr, masked_m_ptr, T, N, K,
                   stride_ae, stride_am, stride_ase, stride_asm, stride_ask,
                   stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                   stride_oe, stride_om, a_desc, w_desc,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, TMA: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr):
    e = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(T, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    valid = tl.minimum(tl.load(masked_m_ptr + e), T)
    if pid_m * BLOCK_M < valid:  # tiles past masked_m[e] do nothing
        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_m, valid - 1)
        cols = tl.minimum(offs_n, N - 1)
        # TMA rows: A is [E*T, K] (rows past valid may be the next expert's: never stored).
        acc = _block_scaled_mma(a_ptr + e * stride_ae, a_s_ptr + e * stride_ase,
                                w_ptr + e * stride_we, w_s_ptr + e * stride_wse,
                                rows, cols, K, stride_am, stride_asm, stride_ask,
                                stride_wn, stride_wsn, stride_wsk, a_desc, w_desc,
                                (e * T + pid_m * BLOCK_M).to(tl.int32),
                                (e * N + pid_n * BLOCK_N).to(tl.int32),
                                BLOCK_M, BLOCK_N, BLOCK_K, TMA, IMPRECISE_ACC, WARP_SPECIALIZE)
        out_ptrs = out_ptr + e * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :]
        out_mask = (offs_m[:, None] < valid) & (offs_n[None, :] < N)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# ----------------------------------------------------------------------------------------------
# Launchers (arguments already validated)
# ----------------------------------------------------------------------------------------------
def grouped_fp8_gemm_contiguous_triton(a, w, out, m_indices, config: dict | None = None):
    """Triton launcher of `grouped_fp8_gemm_contiguous` (same arguments, no validation).

    config: optional overrides of `DEFAULT_CONFIG` (see above; `contiguous_config` gives the
    config run).
    """
    (a_q, a_s), (w_q, w_s) = a, w
    M, K = a_q.shape
    N = w_q.shape[1]
    if M == 0:
        return out
    cfg = contiguous_config(M, w_q.shape[0], config, K)
    descs, kwargs = _launch_args(cfg, a_q, w_q)
    num_tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    # Whole stride tuples: one call each instead of one per dimension (host time).
    _contiguous_kernel[(num_tiles,)](
        a_q, a_s, w_q, w_s, out, m_indices, M, N, K,
        a_q.stride(0), *a_s.stride(), *w_q.stride()[:2], *w_s.stride(), out.stride(0),
        *descs, **kwargs)
    return out


def grouped_fp8_gemm_masked_triton(a, w, out, masked_m, expected_m=None,
                                   config: dict | None = None):
    """Triton launcher of `grouped_fp8_gemm_masked` (same arguments, no validation).

    expected_m is accepted for DeepGEMM's signature; the 64-row default tiles already suit small
    row counts, so it does not change the tiling. `config` overrides `DEFAULT_CONFIG`
    (`masked_config` gives the config run).
    """
    (a_q, a_s), (w_q, w_s) = a, w
    E, T, K = a_q.shape
    N = w_q.shape[1]
    if E == 0 or T == 0:
        return out
    cfg = masked_config(K, config)
    descs, kwargs = _launch_args(cfg, a_q, w_q)
    per_expert = cdiv(T, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    _masked_kernel[(per_expert, E)](
        a_q, a_s, w_q, w_s, out, masked_m, T, N, K,
        *a_q.stride()[:2], *a_s.stride(), *w_q.stride()[:2], *w_s.stride(), *out.stride()[:2],
        *descs, **kwargs)
    return out


# ----------------------------------------------------------------------------------------------
# torch references (one expert at a time; exact FP8 block products, float32 scaling)
# ----------------------------------------------------------------------------------------------
def _block_scaled_gemm_ref(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor,
                           w_s: torch.Tensor) -> torch.Tensor:
    """float32 [R, N] = sum over K blocks kb of P_kb * (a_s[:, kb] * w_s[n // 128, kb]), the
    blocks accumulated in K order as the kernel accumulates them.

    a_q fp8 [R, K], a_s [R, K/128]; w_q fp8 [N, K], w_s [N/128, K/128]. P_kb, a block's dot
    products of FP8 values, is exact: float64 holds every sum of 128 e4m3 products (each a
    multiple of 2**-18 below 2**18), whatever order the matmul adds them in, and it is rounded
    once to float32. Every other step is elementwise, so a row's result does not depend on which
    rows share the call (chunking a layer call changes no bit on CPU).
    """
    R, K = a_q.shape
    N = w_q.shape[0]
    acc = torch.zeros(R, N, dtype=torch.float32, device=a_q.device)
    a_s = a_s.float()
    w_s = w_s.float().repeat_interleave(SCALE_BLOCK, dim=0)[:N]  # [N, K/128]
    for kb in range(K // SCALE_BLOCK):
        cols = slice(kb * SCALE_BLOCK, (kb + 1) * SCALE_BLOCK)
        part = (a_q[:, cols].double() @ w_q[:, cols].double().t()).float()
        acc += part * (a_s[:, kb:kb + 1] * w_s[:, kb])
    return acc


def grouped_fp8_gemm_contiguous_ref(a, w, out, m_indices):
    """torch reference of `grouped_fp8_gemm_contiguous` (any device; -1 rows -> 0); batch
    invariant (`_block_scaled_gemm_ref`)."""
    (a_q, a_s), (w_q, w_s) = a, w
    out[m_indices < 0] = 0
    for e in range(w_q.shape[0]):
        rows = (m_indices == e).nonzero().flatten()
        if rows.numel():
            out[rows] = _block_scaled_gemm_ref(a_q[rows], a_s[rows], w_q[e], w_s[e]).to(out.dtype)
    return out


def grouped_fp8_gemm_masked_ref(a, w, out, masked_m, expected_m=None):
    """torch reference of `grouped_fp8_gemm_masked` (any device; rows >= masked_m kept); batch
    invariant (`_block_scaled_gemm_ref`)."""
    (a_q, a_s), (w_q, w_s) = a, w
    for e, m in enumerate(masked_m.tolist()):
        m = min(max(m, 0), a_q.shape[1])
        if m:
            out[e, :m] = _block_scaled_gemm_ref(a_q[e, :m], a_s[e, :m], w_q[e],
                                                w_s[e]).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _check_pair(name: str, pair, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise ValueError(f"{name}: expected a (fp8 tensor, float32 scales) pair, got {type(pair)}")
    q, s = pair
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE or q.dim() != ndim:
        raise ValueError(f"{name}[0]: expected a {ndim}-D {FP8_DTYPE} tensor, got "
                         f"{getattr(q, 'dtype', type(q))} {tuple(getattr(q, 'shape', ()))}")
    if q.stride(-1) != 1:
        raise ValueError(f"{name}[0]: the K dimension must be contiguous, strides {q.stride()}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise ValueError(f"{name}[1]: expected float32 scales, got {getattr(s, 'dtype', type(s))}")
    return q, s


def _validate(a, w, out, ndim_a: int):
    """Common checks; returns (a_q, a_s, w_q, w_s) and the problem sizes."""
    a_q, a_s = _check_pair("a", a, ndim_a)
    w_q, w_s = _check_pair("w", w, 3)
    K = a_q.shape[-1]
    E, N, Kw = w_q.shape
    if K % SCALE_BLOCK or K == 0:
        raise ValueError(f"a[0]: K must be a positive multiple of {SCALE_BLOCK}, got {K}")
    if Kw != K:
        raise ValueError(f"w[0]: K ({Kw}) differs from a's K ({K})")
    if N % SCALE_BLOCK or N == 0:
        raise ValueError(f"w[0]: N must be a positive multiple of {SCALE_BLOCK}, got {N}")
    if tuple(a_s.shape) != (*a_q.shape[:-1], K // SCALE_BLOCK):
        raise ValueError(f"a[1]: expected scales of shape {(*a_q.shape[:-1], K // SCALE_BLOCK)}, "
                         f"got {tuple(a_s.shape)}")
    if tuple(w_s.shape) != (E, N // SCALE_BLOCK, K // SCALE_BLOCK):
        raise ValueError(f"w[1]: expected scales of shape {(E, N // SCALE_BLOCK, K // SCALE_BLOCK)}"
                         f", got {tuple(w_s.shape)}")
    if not w_q.is_contiguous():
        raise ValueError(f"w[0]: must be contiguous, strides {w_q.stride()}")
    expected_out = (*a_q.shape[:-1], N)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16:
        raise ValueError(f"out: expected a bfloat16 tensor, got {getattr(out, 'dtype', type(out))}")
    if tuple(out.shape) != expected_out:
        raise ValueError(f"out: expected shape {expected_out}, got {tuple(out.shape)}")
    if out.stride(-1) != 1:
        raise ValueError(f"out: the N dimension must be contiguous, strides {out.stride()}")
    return a_q, a_s, w_q, w_s


def _check_devices(**tensors):
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def grouped_fp8_gemm_contiguous(a, w, out, m_indices, config: dict | None = None):
    """Grouped FP8 GEMM over the expert-contiguous layout (DeepGEMM's `..._nt_contiguous`).

    Args:
        a: (a_q, a_s): a_q float8_e4m3fn [M_sum, K] (K contiguous), a_s float32 [M_sum, K/128]
            per-row 1x128 scales, any strides (row-major, or MN-major with the M stride padded).
        w: (w_q, w_s): w_q float8_e4m3fn [E, N, K] contiguous, w_s float32 [E, N/128, K/128]
            128x128 block scales.
        out: bfloat16 [M_sum, N] (N contiguous), written in full.
        m_indices: int32 [M_sum], expert of each row in [0, E) or -1 for padding. Each expert's
            rows are contiguous and start at a multiple of 128 (not checked: that would sync).
        config: optional Triton config overrides (CUDA only), see `DEFAULT_CONFIG`.

    Returns:
        out, with out[i] = (a_q[i] * a_s[i]) @ (w_q[e] * w_s[e])^T for e = m_indices[i] >= 0
        (float32 accumulation), and exact zeros on rows with m_indices[i] == -1.
    """
    a_q, a_s, w_q, w_s = _validate(a, w, out, 2)
    if not isinstance(m_indices, torch.Tensor) or m_indices.dtype != torch.int32:
        raise ValueError(f"m_indices: expected an int32 tensor, got "
                         f"{getattr(m_indices, 'dtype', type(m_indices))}")
    if m_indices.dim() != 1 or m_indices.shape[0] != a_q.shape[0] or not m_indices.is_contiguous():
        raise ValueError(f"m_indices: expected a contiguous [M_sum={a_q.shape[0]}] tensor, got "
                         f"shape {tuple(m_indices.shape)}")
    _check_devices(a_q=a_q, a_s=a_s, w_q=w_q, w_s=w_s, out=out, m_indices=m_indices)
    _resolve_config(config)
    if a_q.is_cuda:
        return grouped_fp8_gemm_contiguous_triton((a_q, a_s), (w_q, w_s), out, m_indices, config)
    return grouped_fp8_gemm_contiguous_ref((a_q, a_s), (w_q, w_s), out, m_indices)


def grouped_fp8_gemm_masked(a, w, out, masked_m, expected_m: int | None = None,
                            config: dict | None = None):
    """Grouped FP8 GEMM over the masked (batched) layout (DeepGEMM's `..._nt_masked`).

    Args:
        a: (a_q, a_s): a_q float8_e4m3fn [E, T, K] (K contiguous), a_s float32 [E, T, K/128], any
            strides (DeepEP's low-latency dispatch gives MN-major scales per expert).
        w: (w_q, w_s): w_q float8_e4m3fn [E, N, K] contiguous, w_s float32 [E, N/128, K/128].
        out: bfloat16 [E, T, N] (N contiguous): rows < masked_m[e] of out[e] are written, the
            others are left untouched.
        masked_m: int32 [E], valid rows of each expert (values above T are treated as T).
        expected_m: optional int, typical valid rows per expert (DeepGEMM's tiling hint; checked,
            not needed by the Triton kernel).
        config: optional Triton config overrides (CUDA only), see `DEFAULT_CONFIG`.

    Returns:
        out, with out[e, i] = (a_q[e, i] * a_s[e, i]) @ (w_q[e] * w_s[e])^T for i < masked_m[e].
    """
    a_q, a_s, w_q, w_s = _validate(a, w, out, 3)
    if a_q.shape[0] != w_q.shape[0]:
        raise ValueError(f"a[0]: {a_q.shape[0]} experts but w[0] has {w_q.shape[0]}")
    if not isinstance(masked_m, torch.Tensor) or masked_m.dtype != torch.int32:
        raise ValueError(f"masked_m: expected an int32 tensor, got "
                         f"{getattr(masked_m, 'dtype', type(masked_m))}")
    if tuple(masked_m.shape) != (a_q.shape[0],) or not masked_m.is_contiguous():
        raise ValueError(f"masked_m: expected a contiguous [E={a_q.shape[0]}] tensor, got shape "
                         f"{tuple(masked_m.shape)}")
    if expected_m is not None and (not isinstance(expected_m, int) or expected_m < 0):
        raise ValueError(f"expected_m: expected a non-negative int or None, got {expected_m!r}")
    _check_devices(a_q=a_q, a_s=a_s, w_q=w_q, w_s=w_s, out=out, masked_m=masked_m)
    _resolve_config(config)
    if a_q.is_cuda:
        return grouped_fp8_gemm_masked_triton((a_q, a_s), (w_q, w_s), out, masked_m, expected_m,
                                              config)
    return grouped_fp8_gemm_masked_ref((a_q, a_s), (w_q, w_s), out, masked_m, expected_m)
