"""Gluon (Hopper, sm_90) kernel of the contiguous grouped FP8 GEMM.

Imported only through `grouped_gemm_gluon._kernel()`, so that importing the package never needs
Gluon. One program computes one [BLOCK_M, BLOCK_N] output tile of one expert (a tile never spans
two experts: BLOCK_M divides the contiguous layout's row alignment). Its K loop::

    TMA ring:   slot s = k % STAGES holds A[rows, k-block] and W[cols, k-block], filled by TMA and
                signalled through mbarrier s (phase (k // STAGES) & 1).
    iteration k:
        wait mbarrier s                        (block k is in shared memory)
        tmp_k = wgmma(A_s, W_s^T)              (asynchronous: the tensor cores start)
        refill the slot of block k - 1 with block k - 1 + STAGES
        acc += tmp_{k-1} * scale_{k-1}         (float32 promotion, while tmp_k is computed)
        scale_k = a_s[rows, k] * w_s[n-block, k]   (loaded here, used next iteration)
        tmp_{k-1} <- wait(tmp_k)

so the promotion of one block overlaps the next block's tensor-core work, which a `tl.dot` in a
loop cannot express (its result must be complete before it is scaled). BLOCK_K is the K extent
of one wgmma chain and of one promotion: 128 (one scale block; DeepGEMM's choice) or 64 / 32
(each half or quarter of a scale block promoted on its own, with that block's scale: the
accuracy of `IMPRECISE_ACC` 64 / 32 in the Triton kernel, not its bits). With WARP_SPECIALIZE
the loads move to a one-warp producer partition that refills slot s once the consumers arrive on
its "empty" barrier (after block k's wgmma is complete), as DeepGEMM splits its warps.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

# triton 3.6 names the tiled TMA load async_copy_global_to_shared; later releases async_load
# (same arguments: descriptor, coordinates, barrier, destination, predicate).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _swizzle(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """(m, n) of a linear tile id: GROUP_M consecutive M tiles share W tiles in L2 (the order of
    the Triton kernel's _swizzle)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@gluon.jit
def _load_block(a_desc, w_desc, a_smem, w_smem, bars, k, num_k, a_row, w_row,
                BLOCK_K: gl.constexpr, STAGES: gl.constexpr, STAGE_BYTES: gl.constexpr):
    """Start the TMA loads of K block k into its ring slot (nothing when k >= num_k)."""
    s = k % STAGES
    pred = k < num_k
    mbarrier.expect(bars.index(s), STAGE_BYTES, pred)
    _tma_load(a_desc, [a_row, k * BLOCK_K], bars.index(s), a_smem.index(s), pred)
    _tma_load(w_desc, [w_row, k * BLOCK_K], bars.index(s), w_smem.index(s), pred)


@gluon.jit
def _wgmma_block(a_smem, w_smem, bars, k, zero, STAGES: gl.constexpr):
    """Wait for K block k's slot and start its asynchronous wgmma into a fresh accumulator (the
    whole block summed in the tensor cores' accumulator)."""
    s = k % STAGES
    mbarrier.wait(bars.index(s), (k // STAGES) & 1)
    w_t = w_smem.index(s).permute((1, 0))  # [BLOCK_K, BLOCK_N], K-major as FP8 wgmma needs
    return warpgroup_mma(a_smem.index(s), w_t, zero, use_acc=False, is_async=True)


@gluon.jit
def _block_scale(a_s_ptrs, w_s_ptr, k, stride_ask, stride_wsk, BLOCK_K: gl.constexpr):
    """a_s[rows, kb] * w_s[n-block, kb] for the scale block kb holding K block k ([BLOCK_M])."""
    kb = (k * BLOCK_K) // 128
    return gl.load(a_s_ptrs + kb * stride_ask) * gl.load(w_s_ptr + kb * stride_wsk)


@gluon.jit
def _block_scaled_wgmma(a_desc, w_desc, a_s_ptrs, w_s_ptr, K, stride_ask, stride_wsk,
                        a_row, w_row, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_K: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] (layout MMA) = sum over K blocks of wgmma(A, W^T) * scale."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()  # the barriers' initialisation is visible to the TMA unit
    STAGE_BYTES: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K
    num_k = K // BLOCK_K
    for k in gl.static_range(STAGES):
        _load_block(a_desc, w_desc, a_smem, w_smem, bars, k, num_k, a_row, w_row,
                    BLOCK_K, STAGES, STAGE_BYTES)

    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    tok = _wgmma_block(a_smem, w_smem, bars, 0, zero, STAGES)
    scale = _block_scale(a_s_ptrs, w_s_ptr, 0, stride_ask, stride_wsk, BLOCK_K)
    prev = warpgroup_mma_wait(0, deps=[tok])
    acc = zero
    for k in range(1, num_k):
        tok = _wgmma_block(a_smem, w_smem, bars, k, zero, STAGES)
        # Block k - 1's wgmma is complete (waited below last iteration): its slot is free.
        _load_block(a_desc, w_desc, a_smem, w_smem, bars, k - 1 + STAGES, num_k, a_row, w_row,
                    BLOCK_K, STAGES, STAGE_BYTES)
        acc += prev * scale[:, None]
        scale = _block_scale(a_s_ptrs, w_s_ptr, k, stride_ask, stride_wsk, BLOCK_K)
        prev = warpgroup_mma_wait(0, deps=[tok])
    acc += prev * scale[:, None]
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    return acc


@gluon.jit
def _ws_load(a_desc, w_desc, a_smem, w_smem, ready, empty, num_k, a_row, w_row,
             BLOCK_K: gl.constexpr, STAGES: gl.constexpr, STAGE_BYTES: gl.constexpr):
    """Producer warp: refill each slot once the consumers have released it (empty[s]; a fresh
    barrier passes the first wait, on parity 1)."""
    for k in range(num_k):
        mbarrier.wait(empty.index(k % STAGES), ((k // STAGES) & 1) ^ 1)
        _load_block(a_desc, w_desc, a_smem, w_smem, ready, k, num_k, a_row, w_row,
                    BLOCK_K, STAGES, STAGE_BYTES)


@gluon.jit
def _ws_consume(a_smem, w_smem, ready, empty, a_s_ptrs, w_s_ptr, num_k, stride_ask, stride_wsk,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, MMA: gl.constexpr):
    """Consumer warpgroups: the loop of _block_scaled_wgmma without the loads; a slot is released
    once its wgmma is complete. num_k 0 (a padding tile) gives zeros."""
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    acc = zero
    prev = zero
    scale = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, MMA))
    for k in range(num_k):
        tok = _wgmma_block(a_smem, w_smem, ready, k, zero, STAGES)
        acc += prev * scale[:, None]
        scale = _block_scale(a_s_ptrs, w_s_ptr, k, stride_ask, stride_wsk, BLOCK_K)
        prev = warpgroup_mma_wait(0, deps=[tok])
        mbarrier.arrive(empty.index(k % STAGES), count=1)
    # A tuple: the default partition's results as every Triton release takes them.
    return (acc + prev * scale[:, None],)


@gluon.jit
def _block_scaled_wgmma_ws(a_desc, w_desc, a_s_ptrs, w_s_ptr, num_k, stride_ask, stride_wsk,
                           a_row, w_row, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           BLOCK_K: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr):
    """_block_scaled_wgmma with a producer warp for the TMA loads (DeepGEMM's split), over num_k
    K blocks."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    STAGE_BYTES: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K
    results = gl.warp_specialize([
        (_ws_consume, (a_smem, w_smem, ready, empty, a_s_ptrs, w_s_ptr, num_k, stride_ask,
                       stride_wsk, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, MMA)),
        (_ws_load, (a_desc, w_desc, a_smem, w_smem, ready, empty, num_k, a_row, w_row, BLOCK_K,
                    STAGES, STAGE_BYTES)),
    ], [1], [24])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    return results[0]


@gluon.jit
def contiguous_kernel(a_desc, w_desc, a_s_ptr, w_s_ptr, out_ptr, m_idx_ptr, M, N, K,
                      stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_om,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                      GROUP_M: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr,
                      WARP_SPECIALIZE: gl.constexpr):
    """out[tile] for one tile; a_desc: A [M, K], w_desc: W [E*N, K] (TMA, zero-filled past the
    end); tiles whose first row is padding (m_indices -1) and padding rows are written as 0."""
    pid_m, pid_n = _swizzle(gl.program_id(0), gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m.to(gl.int64) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    expert = gl.load(m_idx_ptr + pid_m.to(gl.int64) * BLOCK_M)
    # Rows past M are clamped for the scale loads (their TMA rows read as zeros).
    a_s_ptrs = a_s_ptr + gl.minimum(offs_m, M - 1) * stride_asm
    w_s_ptr += expert.to(gl.int64) * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn
    a_row = (pid_m * BLOCK_M).to(gl.int32)
    w_row = (expert * N + pid_n * BLOCK_N).to(gl.int32)
    if WARP_SPECIALIZE:  # one region for every tile: a padding tile runs no K block
        num_k = gl.where(expert >= 0, K // BLOCK_K, 0)
        acc = _block_scaled_wgmma_ws(a_desc, w_desc, a_s_ptrs, w_s_ptr, num_k, stride_ask,
                                     stride_wsk, a_row, w_row, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                                     MMA)
    elif expert >= 0:
        acc = _block_scaled_wgmma(a_desc, w_desc, a_s_ptrs, w_s_ptr, K, stride_ask, stride_wsk,
                                  a_row, w_row, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, MMA)
    else:  # the whole tile is padding
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    # Trailing -1 rows of the expert's last tile are padding: exact zeros.
    row_experts = gl.load(m_idx_ptr + offs_m, mask=offs_m < M, other=-1)
    acc = gl.where((row_experts == expert)[:, None], acc, 0.0)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    gl.store(out_ptrs, acc.to(gl.bfloat16), mask=out_mask)
