"""BatchedTritonExperts and BatchedDeepGemmExperts (fused_moe/batched_experts.py): through the
kernel with a one-rank batched prepare/finalize (DeepGEMM's expected_m), and apply on exact,
poisoned workspaces."""

import types

import pytest
import torch
from _layer import check_close, make_problem, reference, run

from vllm_moe_fixes._compat import deep_gemm as compat
from vllm_moe_fixes.fused_moe.batched_experts import BatchedDeepGemmExperts, BatchedTritonExperts
from vllm_moe_fixes.fused_moe.interfaces import ActivationFormat, PrepareAndFinalize, PrepareResult
from vllm_moe_fixes.fused_moe.modular_kernel import FusedMoEModularKernel
from vllm_moe_fixes.ops.fp8 import SCALE_BLOCK
from vllm_moe_fixes.ops.fp8_quant import quant_batched_fp8
from vllm_moe_fixes.ops.grouped_gemm import grouped_fp8_gemm_masked_ref
from vllm_moe_fixes.sizes import expected_rows_per_expert
from vllm_moe_fixes.testing import Fp8MoEWeights, moe_reference, random_fp8_moe_weights


class LocalBatchedPrepareAndFinalize(PrepareAndFinalize):
    """A one-rank batched prepare/finalize (what a low-latency dispatch at world size 1 does):
    each local expert's tokens in a slice of capacity T = max_tokens * topk rows, the weighted
    sum back per token. For tests of the batched experts through the kernel."""

    activation_format = ActivationFormat.BATCHED

    def __init__(self, max_tokens):
        self.max_tokens = max_tokens

    def max_num_tokens_per_rank(self):
        return self.max_tokens

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input):
        M, K = a1.shape
        T = self.max_tokens * topk_ids.shape[1]
        x = torch.zeros(num_experts, T, K, dtype=a1.dtype)
        counts = torch.zeros(num_experts, dtype=torch.int32)
        self.rows = {}
        for m, j in zip(*torch.nonzero(topk_ids >= 0, as_tuple=True)):
            e = int(topk_ids[m, j])
            self.rows[(int(m), int(j))] = (e, int(counts[e]))
            x[e, counts[e]] = a1[m]
            counts[e] += 1
        a1q, a1s = quant_batched_fp8(x)
        return PrepareResult(a1q=a1q, a1q_scale=a1s, expert_num_tokens=counts)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, *, output_is_reduced=False):
        acc = torch.zeros(output.shape, dtype=torch.float32)
        for (m, j), (e, r) in self.rows.items():
            acc[m] += topk_weights[m, j] * fused_expert_output[e, r].float()
        output.copy_(acc)


def test_batched_experts_through_the_kernel_get_expected_m(monkeypatch):
    """BatchedTritonExperts and (fake) BatchedDeepGemmExperts through a one-rank batched
    prepare/finalize: outputs match the reference; DeepGEMM's masked GEMM gets the capacity
    estimate max_tokens * ranks * topk / E bounded to [1, T], not T."""
    E, k, M, cap = 8, 2, 5, 64  # T = cap * k = 128 rows, as DeepGEMM's masked GEMM needs
    p = make_problem(M, k, E, 128, 256, seed=12)
    out = run(FusedMoEModularKernel(LocalBatchedPrepareAndFinalize(cap), BatchedTritonExperts()),
              p, E)
    check_close(out, reference(p))
    seen = []
    masked = lambda a, b, d, m, expected_m, **kw: (  # noqa: E731
        seen.append(expected_m), grouped_fp8_gemm_masked_ref(a, b, d, m))
    fake = types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=lambda *a, **kw: None,
                                 m_grouped_fp8_gemm_nt_masked=masked)
    monkeypatch.setattr(compat, "_API", compat.resolve(fake))
    out_dg = run(FusedMoEModularKernel(LocalBatchedPrepareAndFinalize(cap),
                                       BatchedDeepGemmExperts()), p, E)
    assert torch.equal(out_dg, out)
    assert seen == [cap * k // E] * 2 == [16, 16]
    assert expected_rows_per_expert(128, 1, 8, 32, 1024) == 32
    assert expected_rows_per_expert(128, 4, 8, 8, 512) == 512  # bounded by T
    assert expected_rows_per_expert(1, 1, 1, 256, 8) == 1
    assert expected_rows_per_expert(None, 1, 8, 32, 77) == 77


def _batched_reference(a_q, a_s, w1, w1s, w2, w2s, counts):
    """float32 reference of the batched experts' valid rows (dequantised input)."""
    out = []
    for e, c in enumerate(counts):
        a = a_q[e, :c].float() * a_s[e, :c].repeat_interleave(SCALE_BLOCK, dim=-1)
        ids = torch.zeros(c, 1, dtype=torch.int64)
        out.append(moe_reference(a, w1[e:e + 1], w2[e:e + 1], torch.ones(c, 1), ids,
                                 w1_scale=w1s[e:e + 1], w2_scale=w2s[e:e + 1]))
    return out


@pytest.mark.parametrize("I,K,T,device", [
    (128, 256, 5, "cpu"), (128, 384, 64, "cpu"), (512, 256, 9, "cpu"), (256, 128, 3, "cpu"),
    pytest.param(128, 7168, 130, "cuda", marks=pytest.mark.gpu),
    pytest.param(2048, 7168, 64, "cuda", marks=pytest.mark.gpu)])
def test_batched_apply_with_exact_poisoned_workspaces(I, K, T, device, monkeypatch):
    """BatchedTritonExperts.apply with workspaces of exactly the declared sizes, NaN-filled, sitting
    between NaN guard bands: every view fits (the guards stay untouched; G' and its scales fill ws2
    to its last byte), and the valid rows match the reference. G''s scales are MN-major per
    expert, right after G'."""
    counts = [3, 0, T, 1]
    local_num_experts = len(counts)
    g = torch.Generator().manual_seed(I + K + T)
    w1, w1s, w2, w2s = random_fp8_moe_weights(local_num_experts, K, I, generator=g)
    x = torch.randn(local_num_experts, T, K, generator=g).bfloat16()
    a_q, a_s = quant_batched_fp8(x.to(device))
    w1, w1s, w2, w2s = (t.to(device) for t in (w1, w1s, w2, w2s))
    experts = BatchedTritonExperts()
    ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(T, I, K, 1, local_num_experts)
    guard = 64
    bufs = []
    for shape in (ws13_shape, ws2_shape):
        n = torch.Size(shape).numel()
        buf = torch.full((n + 2 * guard,), float("nan"), dtype=torch.bfloat16, device=device)
        bufs.append((buf, buf[guard:guard + n].view(shape)))
    (buf13, ws13), (buf2, ws2) = bufs
    out = ws13.view(-1)[:torch.Size(out_shape).numel()].view(out_shape)
    seen = []
    real_gemm = BatchedTritonExperts.gemm

    def gemm(self, a, w, o, m, expected_m):
        seen.append(a)
        return real_gemm(self, a, w, o, m, expected_m)

    monkeypatch.setattr(BatchedTritonExperts, "gemm", gemm)
    experts.apply(out, a_q, a_s, Fp8MoEWeights(w1, w1s, w2, w2s), workspace13=ws13,
                  workspace2=ws2,
                  expert_num_tokens=torch.tensor(counts, dtype=torch.int32, device=device))
    for buf in (buf13, buf2):
        assert buf[:guard].isnan().all() and buf[-guard:].isnan().all()
    g_q, g_s = seen[1]  # GEMM2's input: G' and its scales, filling ws2
    assert g_s.stride() == (T * I // SCALE_BLOCK, 1, T)
    assert g_q.data_ptr() == ws2.data_ptr() and g_q.data_ptr() + g_q.numel() == g_s.data_ptr()
    assert g_s.data_ptr() + g_s.numel() * 4 == ws2.data_ptr() + ws2.numel() * 2
    refs = _batched_reference(*(t.cpu() for t in (a_q, a_s, w1, w1s, w2, w2s)), counts)
    for e, (c, ref) in enumerate(zip(counts, refs)):
        if c:
            check_close(out[e, :c].cpu(), ref)
