"""DeepEPLLPrepareAndFinalize runs both halves of DeepEP's low-latency dispatch and combine on the
caller's stream: it asks for the receive hook (return_recv_hook=True) and calls it before it
hands anything on, so that what the receiving half writes is there when the experts (after the
dispatch) and the caller (after the combine) read it."""

import torch

from vllm_moe_fixes.fused_moe import DeepEPLLPrepareAndFinalize


class HookedBuffer:
    """A one-rank low-latency buffer in DeepEP's hook mode: the send half returns the tensors
    unwritten (NaN / -1), the hook writes them."""

    low_latency_mode = True
    rank, group_size = 0, 1

    def __init__(self, local_num_experts: int, n: int, hidden: int) -> None:
        self.shape = (local_num_experts, n, hidden)
        self.asked = []

    def low_latency_dispatch(self, x, topk_idx, n, num_experts, use_fp8=True,
                             return_recv_hook=False):
        self.asked.append(("dispatch", return_recv_hook, topk_idx.dtype))
        recv = torch.full(self.shape, float("nan"), dtype=torch.bfloat16)
        counts = torch.full((self.shape[0],), -1, dtype=torch.int32)

        def receive():
            recv.zero_()
            recv[0, :x.shape[0]] = x
            counts.zero_()
            counts[0] = x.shape[0]
        return recv, counts, "handle", None, receive if return_recv_hook else None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, out=None,
                            return_recv_hook=False):
        self.asked.append(("combine", return_recv_hook, topk_weights.dtype))
        out.fill_(float("nan"))

        def receive():
            out.copy_(x[0, :out.shape[0]] * topk_weights.sum(1, keepdim=True))
        return out, None, receive if return_recv_hook else None


def test_prepare_and_finalize_call_the_receive_hooks_before_handing_on():
    E_l, n, K, M, k = 2, 4, 128, 3, 2
    buffer = HookedBuffer(E_l, n, K)
    pf = DeepEPLLPrepareAndFinalize(buffer, num_dispatchers=1, max_tokens_per_rank=n,
                                    use_fp8_dispatch=False)
    x = torch.randn(M, K).bfloat16()
    weights = torch.rand(M, k)
    ids = torch.tensor([[0, 1], [1, 0], [0, 0]], dtype=torch.int32)
    prep = pf.prepare(x, weights, ids, E_l, None, False)
    assert int(prep.expert_num_tokens[0]) == M and int(prep.expert_num_tokens[1]) == 0
    assert torch.isfinite(prep.a1q.float()).all()  # the bf16 rows were received, then quantised
    out = torch.empty(M, K, dtype=torch.bfloat16)
    experts_out = torch.randn(E_l, n, K).bfloat16()
    pf.finalize(out, experts_out, weights, ids, False)
    assert torch.equal(out, (experts_out[0, :M] * weights.sum(1, keepdim=True)).bfloat16())
    assert buffer.asked == [("dispatch", True, torch.int64), ("combine", True, torch.float32)]
