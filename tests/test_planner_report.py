"""`plan` with the contiguous experts' bound: zero vs random ids with and without it,
flags only for what can happen in the configuration, information that is not a failure, aligned
columns, and bounded model fields."""

import json

import pytest

from vllm_moe_fixes.config import MAX_FIELD_VALUES, PRESETS, config_from_dict, load_model_config
from vllm_moe_fixes.planner import format_plan, make_plan
from vllm_moe_fixes.sizes import contiguous_workspace_shapes

R1 = PRESETS["deepseek-r1"]
GIB = 2**30


def test_plan_models_the_experts_bound_zero_vs_random_ids():
    """DeepSeek-R1 at DP=32, 8192 tokens per rank, high-throughput: with zero ids one rank
    receives all 262144 tokens. In one pass its experts need 14.4 + 28.0 GiB of workspaces; in
    passes of 8192 tokens ws2 is one pass's and ws13 one pass's plus the [262144, K] output."""
    plan = make_plan(R1, dp=32, max_tokens=8192, backend="deepep_high_throughput")
    assert plan["experts_pass_tokens"] == 8192 and plan["dispatch_chunk_tokens"] == 8192
    zero, random = plan["loads"]["zero"], plan["loads"]["random"]
    assert zero["busiest_tokens"] == 262144
    one = zero["one_pass"]["layer_bytes"]
    assert round(one["workspace13"] / GIB, 2) == 14.44
    assert round(one["workspace2"] / GIB, 2) == 28.04
    ws13, ws2, _ = contiguous_workspace_shapes(262144, 2048, 7168, 8, 8, 8192)
    assert zero["layer_bytes"]["workspace2"] == 2 * ws2[0] * ws2[1]
    assert zero["layer_bytes"]["workspace13"] == 2 * ws13[0] * ws13[1]
    assert zero["layer_bytes"]["workspace2"] == random["layer_bytes"]["workspace2"]  # one pass's
    for loads in (zero, random):  # random ids: the busiest rank receives > 8192 tokens too
        assert loads["busiest_tokens"] > 8192
        assert loads["memory_bytes"] < loads["one_pass"]["memory_bytes"]
        assert loads["layer_bytes"]["recv_x"] == loads["one_pass"]["layer_bytes"]["recv_x"]
    assert zero["one_pass"]["memory_bytes"] - zero["memory_bytes"] > 35 * GIB
    assert zero["memory_bytes"] < 1.25 * random["memory_bytes"]
    text = format_plan(plan)
    assert "experts in passes of 8192 tokens (in effect):" in text
    assert "experts in one pass (no bound):" in text


def test_plan_bound_follows_the_chunk_size_and_the_caller_passes(monkeypatch):
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "4096")
    plan = make_plan(R1, dp=32, max_tokens=16384, backend="naive")
    assert plan["experts_pass_tokens"] == plan["dispatch_chunk_tokens"] == 4096
    assert plan["group_tokens"] == 32 * 4096  # one pass of the layer: 4096 tokens per rank
    assert plan["loads"]["zero"]["busiest_tokens"] == 32 * 4096
    ws13, ws2, _ = contiguous_workspace_shapes(32 * 4096, 2048, 7168, 8, 8, 4096)
    assert plan["loads"]["zero"]["layer_bytes"]["workspace2"] == 2 * ws2[0] * ws2[1]
    assert plan["loads"]["zero"]["layer_bytes"]["layer_output"] == 16384 * 7168 * 2
    assert "4 dispatch chunk(s) of 4096 tokens per rank" in format_plan(plan)


def test_plan_bound_changes_nothing_below_it_and_the_batched_layout_needs_none():
    small = make_plan(R1, dp=8, max_tokens=128, backend="naive")["loads"]["random"]
    assert small["busiest_tokens"] <= 8192
    assert small["layer_bytes"] == small["one_pass"]["layer_bytes"]
    ll = make_plan(R1, dp=32, max_tokens=128, backend="deepep_low_latency")
    assert ll["experts_pass_tokens"] is None
    for inputs in ("zero", "random"):
        assert ll["loads"][inputs]["layer_bytes"] == ll["loads"][inputs]["one_pass"]["layer_bytes"]
    assert ll["loads"]["zero"]["layer_bytes"] == ll["loads"]["random"]["layer_bytes"]
    assert "bounded by its capacity" in format_plan(ll)


@pytest.mark.parametrize("backend, dp", [("naive", 128), ("deepep_high_throughput", 128),
                                         ("deepep_low_latency", 1)])
def test_fixed_rdma_flag_only_with_a_low_latency_rdma_buffer(backend, dp):
    plan = make_plan(R1, dp=dp, max_tokens=128, backend=backend)
    flag = plan["flags"]["fixed_rdma_below_ll_hint"]
    assert not flag["raised"] and "no low-latency RDMA buffer" in flag["detail"]
    assert "1908410496" in flag["detail"]  # what deepep_low_latency would need, as information
    flag = make_plan(R1, dp=128, max_tokens=128, backend="deepep_low_latency")["flags"][
        "fixed_rdma_below_ll_hint"]
    assert flag["raised"] and "assertion" in flag["detail"]


def test_int32_elements_are_information_not_a_flag():
    """Our kernels compute 64-bit offsets: a tensor past 2**31 elements is not a failure here,
    only a note that a 32-bit kernel would break on it."""
    plan = make_plan(R1, dp=128, max_tokens=65536, backend="naive")
    assert not [name for name in plan["flags"] if "int32" in name]
    zero = plan["loads"]["zero"]
    assert zero["largest_tensor"]["elements"] == 128 * 8192 * 7168 > 2**31  # received, bounded
    assert zero["one_pass"]["largest_tensor"]["elements"] > zero["largest_tensor"]["elements"]
    note = plan["notes"]["int32_elements_zero_inputs"]
    assert "32-bit offsets would break" in note and "64-bit" in note
    assert "below 2**31" in make_plan(R1, dp=8, max_tokens=128)["notes"][
        "int32_elements_random_inputs"]
    assert "[info] int32_elements_zero_inputs" in format_plan(plan)


def test_plan_columns_stay_aligned_for_huge_values():
    plan = make_plan(R1, dp=128, max_tokens=65536, backend="naive")
    plan["loads"]["zero"]["one_pass"]["largest_tensor"]["elements"] = 10**18
    plan["weight_bytes"] = 10**17
    lines = format_plan(plan).split("\n")
    start = lines.index(next(line for line in lines if line.startswith("per rank")))
    table = lines[start:lines.index("", start)]
    rows = [line for line in table if not line.endswith(":")]  # section headings end with ':'
    assert len(rows) > 10 and len({len(line) for line in rows}) == 1, rows
    header = rows[0]
    for line in rows:  # both value columns end where their headings end
        assert line[header.index("zero ids") + len("zero ids") - 1] != " "
    assert any("1000000000000000000" in line for line in rows)


@pytest.mark.parametrize("field", sorted(MAX_FIELD_VALUES))
def test_model_fields_have_upper_bounds(field, tmp_path):
    limit = MAX_FIELD_VALUES[field]
    with pytest.raises(ValueError, match=f"{field} must be an int in \\[1, {limit}\\]"):
        config_from_dict({**R1.to_dict(), field: limit + 1})
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({**{k: v for k, v in R1.to_dict().items() if k != "name"},
                                field: 10**12}))
    with pytest.raises(ValueError, match=field):
        load_model_config(str(path))


def test_a_model_at_the_limits_plans():
    """hidden and experts at their limits: the planner answers (no MemoryError) in seconds."""
    cfg = config_from_dict({"hidden_size": MAX_FIELD_VALUES["hidden_size"],
                            "moe_intermediate_size": 2048,
                            "num_experts": MAX_FIELD_VALUES["num_experts"], "top_k": 8,
                            "vocab_size": MAX_FIELD_VALUES["vocab_size"], "num_layers": 4})
    plan = make_plan(cfg, dp=8, max_tokens=64)
    assert plan["loads"]["zero"]["busiest_tokens"] == 8 * 64
