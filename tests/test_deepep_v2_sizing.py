"""deepep_v2_sizing: DeepEP V2's ElasticBuffer hint and limits, against values worked by hand
from DeepEP main's formulas (csrc/elastic/buffer.hpp, deep_ep/include/deep_ep/common/layout.cuh).
The comparison with DeepEP's own hint needs V2 and GPUs (tests/test_deep_ep_v2_real.py)."""

import pytest

from vllm_moe_fixes.distributed import deepep_v2_sizing as v2

MiB = 2**20


def hint(n, h, r, **kw):
    return v2.elastic_buffer_size_hint(n, h, num_ranks=r, **kw)


def test_token_slots():
    # FP8 row 7168 B + 224 scale packs (896 B) + k=8 metadata (8*8 + 9*4 = 100 -> 128 B)
    assert v2.token_bytes(7168, 896, 8, True) == 8192
    # combine: bf16 row 14336 B + ids and weights 64 B
    assert v2.token_bytes(14336, 0, 8, False) == 14400
    # every part rounds up to 32 bytes: 4 B of scales take 32
    assert v2.token_bytes(32, 4, 1, True) == 32 + 32 + 32
    with pytest.raises(ValueError, match="multiple of 32 bytes"):
        v2.token_bytes(48, 0, 1, False)


@pytest.mark.parametrize("n, h, r, kw, want", [
    # EP8 decode, FP8 dispatch, k=8: combine 14400 * 8 * 128 = 14,745,600 -> 16 MiB
    (128, 7168, 8, dict(num_topk=8, use_fp8_dispatch=True), 16 * MiB),
    # EP8 prefill, bf16, k=0 sizes for 32: dispatch 14752 * 4096 * 8 = 483,393,536 -> 231 x 2 MiB
    (4096, 7168, 8, {}, 231 * 2 * MiB),
    # two nodes of 8, hybrid: combine 14400 * (8*2*128 + 2*128 + 2*(128 + 1280)) -> 36 x 2 MiB
    (128, 7168, 16, dict(num_topk=8, use_fp8_dispatch=True), 36 * 2 * MiB),
    # the same without hybrid mode: one scale-up domain of 16 that is not NVLink, so send areas
    # count: combine 14400*16*128 + 14400*8*128 = 44,236,800 -> 22 x 2 MiB
    (128, 7168, 16, dict(num_topk=8, use_fp8_dispatch=True, allow_hybrid_mode=False), 44 * MiB),
    # EP2: combine recv min(2, 8) = 2 tokens per slot: 3,686,400 -> 4 MiB ...
    (128, 7168, 2, dict(num_topk=8, use_fp8_dispatch=True), 4 * MiB),
    # ... without multiple reduction k = 8 of them: 14,745,600 -> 16 MiB
    (128, 7168, 2, dict(num_topk=8, use_fp8_dispatch=True, allow_multiple_reduction=False),
     16 * MiB),
    # one rank: combine 14400 * 128 = 1,843,200 -> 2 MiB
    (128, 7168, 1, dict(num_topk=8, use_fp8_dispatch=True), 2 * MiB),
])
def test_hint_worked_values(n, h, r, kw, want):
    assert hint(n, h, r, **kw) == want


def test_hint_grows_with_each_size():
    base = hint(128, 4096, 4, num_topk=6, use_fp8_dispatch=True)
    assert base % (2 * MiB) == 0
    assert hint(256, 4096, 4, num_topk=6, use_fp8_dispatch=True) > base
    assert hint(128, 8192, 4, num_topk=6, use_fp8_dispatch=True) > base
    assert hint(128, 4096, 4, num_topk=0, use_fp8_dispatch=True) >= base  # 0 sizes for 32


def test_domains():
    assert v2.domains(8) == (1, 8, True)
    assert v2.domains(32) == (4, 8, True)
    assert v2.domains(32, allow_hybrid_mode=False) == (1, 32, False)
    assert v2.domains(72, 72) == (1, 72, True)  # one multi-node NVLink domain
    with pytest.raises(ValueError, match="multiple of the NVLink domain"):
        v2.domains(12)


def test_workspace_and_footprint():
    # counters, tails and AGRS signals of WorkspaceLayout::get_num_bytes(): 12,820,528 bytes
    assert v2.workspace_bytes() == 12820528
    assert v2.elastic_buffer_footprint_bytes(16 * MiB) == 16 * MiB + 14 * MiB


@pytest.mark.parametrize("changes, match", [
    (dict(num_experts=12, num_ranks=8), "not divisible"),
    (dict(num_experts=4096, num_ranks=16), "at most 2048"),
    (dict(num_experts=512, num_ranks=1), "at most 256 per rank"),
    (dict(num_ranks=2048, num_experts=2048), "at most 1024 ranks"),
    (dict(num_topk=33), r"num_topk=33 must be an int in \[0, 32\]"),
    (dict(hidden=48), "hidden % 32"),
    (dict(hidden=24, use_fp8_dispatch=False), "hidden % 16"),
    (dict(num_ranks=12, num_experts=24), "multiple of the NVLink domain"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank=0 must be a positive int"),
])
def test_refusals(changes, match):
    args = dict(num_ranks=8, max_tokens_per_rank=128, hidden=7168, num_experts=256, num_topk=8)
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        v2.check_elastic_config(**args)


def test_check_returns_the_hint():
    got = v2.check_elastic_config(num_ranks=8, max_tokens_per_rank=128, hidden=7168,
                                  num_experts=256, num_topk=8)
    assert got == hint(128, 7168, 8, num_topk=8, use_fp8_dispatch=True) == 16 * MiB


def test_planner_reports_v2_beside_v1():
    import dataclasses

    from vllm_moe_fixes.config import PRESETS
    from vllm_moe_fixes.planner import format_plan, make_plan
    cfg = PRESETS["deepseek-r1"]
    want = v2.check_elastic_config(num_ranks=16, max_tokens_per_rank=128, hidden=7168,
                                   num_experts=256)
    plan = make_plan(cfg, dp=16, max_tokens=128, backend="naive")
    assert plan["deepep"]["v2_hint_bytes"] == want and plan["buffer_bytes"] == 0
    assert plan["deepep"]["v2_buffer_bytes"] == v2.elastic_buffer_footprint_bytes(want)
    plan = make_plan(cfg, dp=16, max_tokens=128, backend="deepep_v2")
    assert plan["buffer_bytes"] == v2.elastic_buffer_footprint_bytes(want)
    assert plan["layout"] == "standard" and not plan["flags"]["deepep_cannot_serve"]["raised"]
    assert "DeepEP V2: ElasticBuffer hint" in format_plan(plan)
    # 1024 experts on 2 ranks: 512 local experts, more than V2 takes.
    wide = dataclasses.replace(cfg, num_experts=1024)
    plan = make_plan(wide, dp=2, max_tokens=64, backend="deepep_v2")
    assert plan["deepep"]["v2_hint_bytes"] is None
    flag = plan["flags"]["deepep_cannot_serve"]
    assert flag["raised"] and "at most 256 per rank" in flag["detail"]
