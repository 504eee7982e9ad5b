"""The kernel's workspaces (fused_moe/workspaces.py): reused, grown, shared between layers; the
experts' views cached on them; the declared shapes against vllm_moe_fixes.sizes."""

import torch
from _layer import check_close, make_problem, new_kernel, reference, run, ws_ptrs

from vllm_moe_fixes.fused_moe.batched_experts import BatchedTritonExperts
from vllm_moe_fixes.fused_moe.contiguous_experts import TritonExperts, workspace_views
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.fused_moe.no_ep_prepare_finalize import NoEPPrepareAndFinalize
from vllm_moe_fixes.fused_moe.workspaces import Workspaces
from vllm_moe_fixes.sizes import (
    LAYOUT_INDEX_COLUMNS,
    ROW_ALIGNMENT,
    batched_workspace_shapes,
    contiguous_workspace_shapes,
    layer_declared_bytes,
)


def test_workspaces_keep_their_buffers_for_another_spelling_of_the_device():
    """A device named as a string (or, on CUDA, without an index) is the buffers' device: the
    buffers stay, and a second request of the same spelling returns the same views."""
    spaces = Workspaces()
    first = spaces.get((4, 8), (16,), torch.device("cpu"), torch.bfloat16)
    generation, buffers = spaces.generation, (spaces.ws13, spaces.ws2)
    second = spaces.get((2, 8), (8,), "cpu", torch.bfloat16)
    assert spaces.generation == generation and (spaces.ws13, spaces.ws2) == buffers
    assert second[0].data_ptr() == first[0].data_ptr()
    assert spaces.get((2, 8), (8,), "cpu", torch.bfloat16) is second


def test_workspaces_reused_and_grown():
    kernel = new_kernel()
    p = make_problem(64, 2, 8, 128, 256, seed=1)
    run(kernel, p, 8)
    ptrs, sizes = ws_ptrs(kernel), (kernel.workspaces.ws13.numel(), kernel.workspaces.ws2.numel())
    # same M, then smaller M: same buffers, no new ones
    for M in (64, 5):
        q = make_problem(M, 2, 8, 128, 256, seed=M)
        check_close(run(kernel, q, 8), reference(q))
        assert ws_ptrs(kernel) == ptrs
        assert (kernel.workspaces.ws13.numel(), kernel.workspaces.ws2.numel()) == sizes
    # larger M: both grow
    big = make_problem(300, 2, 8, 128, 256, seed=3)
    check_close(run(kernel, big, 8), reference(big))
    assert kernel.workspaces.ws13.numel() > sizes[0] and kernel.workspaces.ws2.numel() > sizes[1]
    # a shared Workspaces serves a second kernel (another layer) without allocating
    other = FusedMoEModularKernel(NoEPPrepareAndFinalize(), TritonExperts(), kernel.workspaces)
    ptrs = ws_ptrs(kernel)
    run(other, p, 8)
    assert ws_ptrs(other) == ptrs


def test_workspace_views_are_reused_until_a_buffer_grows():
    """Same request -> the same view objects (and the experts' views cached on them); a growth
    drops them all."""
    ws = Workspaces()
    cpu = torch.device("cpu")
    a = ws.get((4, 8), (2, 8), cpu, torch.bfloat16)
    assert ws.get((4, 8), (2, 8), cpu, torch.bfloat16) is a
    shapes = TritonExperts().workspace_shapes(3, 128, 256, 2, 2)
    w13, w2 = ws.get(shapes[0], shapes[1], cpu, torch.bfloat16)
    v = workspace_views(w13, w2, 6, 2, 256, 128)
    assert workspace_views(w13, w2, 6, 2, 256, 128) is v
    assert v.layout.m_indices.data_ptr() == w2.data_ptr() + (w2.numel() - 8 * w2.shape[0]) * 2
    bigger = TritonExperts().workspace_shapes(300, 128, 256, 2, 2)
    grown = ws.get(bigger[0], bigger[1], cpu, torch.bfloat16)
    assert ws.get(shapes[0], shapes[1], cpu, torch.bfloat16)[1] is not w2
    assert grown[0].data_ptr() == ws.ws13.data_ptr()


def test_sizes_module_is_torch_free_and_matches_the_experts():
    import subprocess
    import sys
    code = ("import sys, vllm_moe_fixes.sizes as s; assert 'torch' not in sys.modules; "
            "print(s.ROW_ALIGNMENT)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "128"
    for M, I, K, k, local_num_experts in [(130, 128, 256, 6, 32), (7, 512, 256, 2, 4),
                                          (1, 2048, 7168, 8, 32)]:
        assert TritonExperts().workspace_shapes(M, I, K, k, local_num_experts) == \
            contiguous_workspace_shapes(M, I, K, k, local_num_experts)
        assert BatchedTritonExperts().workspace_shapes(M, I, K, k, local_num_experts) == \
            batched_workspace_shapes(M, I, K, local_num_experts)
    # batched: ws13 H [2I] or Y [K] per row; ws2 G' [I/2] + G''s scales [I/64] per row.
    assert batched_workspace_shapes(5, 128, 256, 3) == ((3, 5, 256), (3, 5, 64 + 2), (3, 5, 256))
    assert batched_workspace_shapes(5, 512, 1152, 3) == ((3, 5, 1152), (3, 5, 256 + 8),
                                                           (3, 5, 1152))
    # contiguous: ws13 A [K/2 + K/64] or G' [I/2 + I/64] or the output; ws2 H [2I] or Y [K] + 8.
    m_sum = (130 * 6 + 32 * 127 + 127) // ROW_ALIGNMENT * ROW_ALIGNMENT
    assert layer_declared_bytes(130, 128, 256, 6, 32) == \
        2 * (m_sum * (128 + 4) + m_sum * (256 + 8)) + 130 * 256 * 2 + 130 * 256 + 130 * 2 * 4


def test_declared_workspace_shapes():
    ws13, ws2, out = TritonExperts().workspace_shapes(130, 128, 256, 6, 32)
    m_sum = (130 * 6 + 32 * 127 + 127) // ROW_ALIGNMENT * ROW_ALIGNMENT
    assert ws13 == (m_sum, 132) and ws2 == (m_sum, 256 + LAYOUT_INDEX_COLUMNS)
    assert out == (130, 256)  # reduced
    assert TritonExperts().workspace_shapes(7, 512, 256, 2, 4)[:2] == ((640, 264), (640, 1032))
    # k = 1: the reduced output [M, K] can need more of ws13 than A or G'
    ws13, _, out = TritonExperts().workspace_shapes(1000, 128, 7168, 1, 2)
    assert ws13[0] * ws13[1] >= 1000 * 7168 and ws13[1] > 7168 // 2 + 7168 // 64
    assert TritonExperts().reduces_output and not BatchedTritonExperts().reduces_output
