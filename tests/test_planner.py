"""Model presets, the routing simulation and the per-rank plan."""

import dataclasses
import json
import re
import time

import numpy as np
import pytest

from vllm_moe_fixes.config import PRESETS, MoEModelConfig, config_from_dict, load_model_config
from vllm_moe_fixes.planner import SimulatedRouter, format_plan, make_plan, simulate_loads

R1 = PRESETS["deepseek-r1"]


# ------------------------------------------------------------------------------------- config
def test_presets_have_public_shapes():
    assert (R1.hidden_size, R1.moe_intermediate_size, R1.num_experts, R1.top_k) == (7168, 2048, 256, 8)
    assert (R1.n_group, R1.topk_group, R1.scoring, R1.vocab_size) == (8, 4, "sigmoid", 129280)
    assert PRESETS["deepseek-v3"].to_dict() | {"name": "x"} == R1.to_dict() | {"name": "x"}
    assert PRESETS["mixtral-8x7b"].num_experts == 8 and PRESETS["mixtral-8x7b"].top_k == 2
    assert PRESETS["qwen3-30b-a3b"].hidden_size == 2048
    assert PRESETS["qwen3-235b-a22b"].num_moe_layers == 94
    assert set(PRESETS) == {"deepseek-v3", "deepseek-r1", "qwen3-30b-a3b", "qwen3-235b-a22b",
                            "mixtral-8x7b"}


def test_json_config_round_trip(tmp_path):
    path = tmp_path / "tiny.json"
    fields = {k: v for k, v in R1.to_dict().items() if k != "name"}
    path.write_text(json.dumps(fields))
    cfg = load_model_config(str(path))
    assert cfg.name == "tiny" and cfg.to_dict() | {"name": "deepseek-r1"} == R1.to_dict()


@pytest.mark.parametrize("change, match", [
    ({"hidden_size": 0}, "hidden_size"),
    ({"top_k": "8"}, "top_k"),
    ({"scoring": "relu"}, "scoring"),
    ({"n_group": 7}, "n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"top_k": 129, "topk_group": 4}, "top_k"),
    ({"num_dense_layers": 61}, "num_dense_layers"),
    ({"bogus": 1}, "bogus"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),
    ({"routed_scaling_factor": True}, "routed_scaling_factor"),
    ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor"),
])
def test_json_config_validation(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({**R1.to_dict(), **change})


def test_json_config_missing_field_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="missing.*vocab_size"):
        config_from_dict({"hidden_size": 1024, "moe_intermediate_size": 256, "num_experts": 8,
                          "top_k": 2, "num_layers": 2})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_model_config(str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        load_model_config(str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        load_model_config("gpt-9")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_model_config(str(tmp_path / "list.json"))


# ------------------------------------------------------------------------------------ routing
def test_grouped_routing_respects_groups():
    router = SimulatedRouter(R1, seed=3)
    ids = np.random.default_rng(0).integers(0, R1.vocab_size, 500)
    topk = router.route(ids)
    assert topk.shape == (500, 8) and topk.dtype == np.int64
    assert all(len(set(row)) == 8 for row in topk)  # distinct experts
    groups = topk // (R1.num_experts // R1.n_group)
    assert max(len(set(row)) for row in groups) <= R1.topk_group
    # Equal ids route alike.
    again = router.route(np.concatenate([ids[:5], ids[:5]]))
    assert np.array_equal(again[:5], again[5:])


@pytest.mark.parametrize("name, ep", [("deepseek-r1", 32), ("qwen3-30b-a3b", 16), ("mixtral-8x7b", 8)])
def test_zero_ids_concentrate_on_the_ranks_of_k_experts(name, ep):
    cfg = PRESETS[name]
    router = SimulatedRouter(cfg, seed=0)
    tokens = 4096
    loads = simulate_loads(router, ep=ep, num_tokens=tokens, inputs="zero")
    experts = router.route(np.zeros(1, dtype=np.int64))[0]
    ranks = set((experts // (cfg.num_experts // ep)).tolist())
    assert set(np.flatnonzero(loads.slots).tolist()) == ranks
    assert loads.slots.sum() == tokens * cfg.top_k
    assert all(loads.tokens[r] == tokens for r in ranks)  # every token visits each of those ranks
    imbalance = loads.slots.max() / loads.slots.mean()
    assert imbalance >= ep / cfg.top_k  # at least EP/k worse than perfect balance


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ids_balance_deepseek_r1_ep32(seed):
    plan = make_plan(R1, dp=32, max_tokens=256, backend="naive", seed=seed)
    random, zero = plan["loads"]["random"], plan["loads"]["zero"]
    assert random["imbalance"] <= 1.25
    assert zero["imbalance"] >= 4.0  # the all-zero figure: >= EP/k
    assert random["mean_slots"] == zero["mean_slots"] == 32 * 256 * 8 / 32
    assert sum(random["slots_per_rank"]) == pytest.approx(32 * 256 * 8, rel=1e-3)


def test_simulation_is_deterministic():
    a = make_plan(R1, dp=8, seed=5)["loads"]["random"]["slots_per_rank"]
    b = make_plan(R1, dp=8, seed=5)["loads"]["random"]["slots_per_rank"]
    c = make_plan(R1, dp=8, seed=6)["loads"]["random"]["slots_per_rank"]
    assert a == b and a != c


# --------------------------------------------------------------------------------------- plan
def test_plan_flags_the_failure_modes():
    # DP=128 low latency with a fixed 1 GiB RDMA buffer: below DeepEP's hint.
    plan = make_plan(R1, dp=128, max_tokens=128, backend="deepep_low_latency")
    flags = {name: f["raised"] for name, f in plan["flags"].items()}
    # DeepEP's hint at N=128, H=7168, E=256.
    assert plan["deepep"]["ll_rdma_hint_bytes"] == 1_908_410_496
    assert flags["fixed_rdma_below_ll_hint"]
    assert not flags["ll_unsupported_hidden"] and not flags["block_quant_shapes"]
    assert plan["layout"] == "batched"
    # The batched layout's tensors do not depend on the routing: T = ep * max_tokens rows per slice.
    assert plan["loads"]["zero"]["largest_tensor"] == plan["loads"]["random"]["largest_tensor"]
    assert plan["loads"]["zero"]["layer_bytes"] == plan["loads"]["random"]["layer_bytes"]
    # int32 element counts: information (our kernels take 64-bit offsets), not flags.
    big = make_plan(R1, dp=32, max_tokens=8192, backend="naive")
    assert big["loads"]["zero"]["one_pass"]["largest_tensor"]["elements"] >= 2**31
    assert "int32_elements_zero_inputs" in big["notes"]
    # Unsupported LL hidden size.
    odd = config_from_dict({**R1.to_dict(), "hidden_size": 1024, "name": "odd"})
    assert make_plan(odd, dp=8)["flags"]["ll_unsupported_hidden"]["raised"]


def test_plan_counts_the_deepep_buffer_footprint():
    # NVSHMEM's first 512 MiB heap step, the hint rounded up to further steps (it does not fit
    # in the first), DeepEP's 32 MiB workspace and NVSHMEM's fixed cost, not the hint alone.
    plan = make_plan(R1, dp=8, max_tokens=128, backend="deepep_low_latency")
    hint = plan["deepep"]["ll_rdma_hint_bytes"]
    assert hint > 2**29
    heap = 2**29 + -(-hint // 2**29) * 2**29
    assert plan["buffer_bytes"] == 32 * 2**20 + heap + 2338 * 2**20 > hint + 2 * 2**30
    assert plan["deepep"]["buffer_kwargs"] == {"num_nvl_bytes": 0, "num_rdma_bytes": hint}
    layer = sum(plan["loads"]["zero"]["layer_bytes"].values())
    assert plan["loads"]["zero"]["memory_bytes"] == plan["weight_bytes"] + plan["buffer_bytes"] + layer
    # Intranode high throughput: no NVSHMEM, the NVLink buffer (2 MiB pages) and the workspace.
    ht = make_plan(R1, dp=8, max_tokens=128, backend="deepep_high_throughput")
    assert ht["buffer_bytes"] == 1024 * 2**20 + 2 * 2**20 + 32 * 2**20
    assert make_plan(R1, dp=8, max_tokens=128, backend="naive")["buffer_bytes"] == 0
def test_plan_oom_flag_zero_vs_random():
    plan = make_plan(R1, dp=32, max_tokens=4096, backend="naive")
    zero, random = plan["loads"]["zero"]["memory_bytes"], plan["loads"]["random"]["memory_bytes"]
    assert zero > random  # the bound keeps them close; without it zero ids take 1.5x or more
    loads = plan["loads"]
    assert loads["zero"]["one_pass"]["memory_bytes"] > 1.5 * loads["random"]["one_pass"][
        "memory_bytes"]
    budget = (zero + random) / 2 / 2**30
    flagged = make_plan(R1, dp=32, max_tokens=4096, backend="naive", gpu_memory_gib=budget)["flags"]
    assert flagged["dummy_run_oom_zero_inputs"]["raised"]
    assert not flagged["dummy_run_oom_random_inputs"]["raised"]


def _cfg(**change):
    return config_from_dict({**R1.to_dict(), "name": "changed", **change})


# (model, backend, dp, max_tokens, env, reason): each a configuration DeepEP v1.2.1 refuses.
REFUSED = [
    (R1, "deepep_high_throughput", 256, 256, {}, "num_ranks=256 has no tuned DeepEP v1.2.1 config"),
    (_cfg(num_experts=240), "deepep_high_throughput", 24, 128, {}, "high-throughput kernels"),
    (_cfg(hidden_size=4097), "deepep_high_throughput", 8, 128, {}, "hidden=4097"),
    (R1, "deepep_high_throughput", 16, 128, {"VLLM_DEEPEP_BUFFER_SIZE_MB": "2048"}, "< 2048 MiB"),
    (_cfg(num_experts=512), "deepep_high_throughput", 2, 128, {}, "at most 128"),
    (R1, "deepep_low_latency", 2, 1, {}, "must be a multiple of 4"),
    (_cfg(num_experts=240), "deepep_low_latency", 12, 128, {}, "multiple of 8"),
    (_cfg(hidden_size=3072), "deepep_low_latency", 8, 128, {}, "hidden=3072 is not supported"),
]
# Configurations DeepEP v1.2.1 serves (at the edges of the rules above).
SERVED = [
    (R1, "deepep_high_throughput", 128, 128, {}),
    (R1, "deepep_high_throughput", 8, 128, {"VLLM_DEEPEP_BUFFER_SIZE_MB": "2048"}),
    (R1, "deepep_high_throughput", 16, 128, {"VLLM_DEEPEP_BUFFER_SIZE_MB": "2047"}),
    (R1, "deepep_low_latency", 128, 128, {}),
    (_cfg(num_experts=240), "deepep_low_latency", 6, 128, {}),
    (R1, "deepep_low_latency", 32, 8192, {}),  # 64 GiB of buffer: no offset limit in DeepEP
]


@pytest.mark.parametrize("cfg, backend, dp, max_tokens, env, reason", REFUSED)
def test_plan_flags_configurations_deepep_cannot_serve(cfg, backend, dp, max_tokens, env, reason,
                                                       monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plan = make_plan(cfg, dp=dp, max_tokens=max_tokens, backend=backend)
    flag = plan["flags"]["deepep_cannot_serve"]
    assert flag["raised"] and reason in flag["detail"] and backend in flag["detail"]


@pytest.mark.parametrize("cfg, backend, dp, max_tokens, env",
                         [case[:5] for case in REFUSED] + SERVED)
def test_plan_flags_exactly_what_make_all2all_buffer_refuses(cfg, backend, dp, max_tokens, env,
                                                             monkeypatch):
    """The planner and make_all2all_buffer share their checks: the plan flags a configuration
    exactly when building its buffer raises ValueError (otherwise building reaches DeepEP)."""
    from vllm_moe_fixes._compat import deep_ep
    from vllm_moe_fixes.distributed import buffers
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(buffers, "group_rank_and_size", lambda group, name="group": (0, dp))
    def no_deep_ep(backend):
        raise ImportError("stop before building")

    monkeypatch.setattr(deep_ep, "require", no_deep_ep)
    plan = make_plan(cfg, dp=dp, max_tokens=max_tokens, backend=backend)
    flag = plan["flags"]["deepep_cannot_serve"]
    # the plan's detail quotes the refusal make_all2all_buffer raises
    refusal = flag["detail"].partition("cannot run this configuration: ")[2]
    with pytest.raises(ValueError if flag["raised"] else ImportError,
                       match=re.escape(refusal) if flag["raised"] else "stop before building"):
        buffers.make_all2all_buffer(backend, None, max_tokens_per_rank=max_tokens,
                                    hidden=cfg.hidden_size, num_experts=cfg.num_experts)


def test_plan_flags_block_quant_shapes():
    assert make_plan(_cfg(hidden_size=4097), dp=8)["flags"]["block_quant_shapes"]["raised"]
    plan = make_plan(_cfg(moe_intermediate_size=2000), dp=8)
    assert plan["flags"]["block_quant_shapes"]["raised"]
    assert not make_plan(R1, dp=8)["flags"]["block_quant_shapes"]["raised"]


@pytest.mark.parametrize("backend, dp", [("deepep_high_throughput", 128), ("deepep_low_latency", 128),
                                         ("naive", 256), ("deepep_low_latency", 1)])
def test_plan_does_not_flag_configurations_deepep_serves(backend, dp):
    plan = make_plan(R1, dp=dp, max_tokens=128, backend=backend)
    assert not plan["flags"]["deepep_cannot_serve"]["raised"]


def test_plan_is_fast_for_every_preset():
    for name, cfg in PRESETS.items():
        for dp in (1, 8, 128 if cfg.num_experts % 128 == 0 else 8):
            start = time.perf_counter()
            make_plan(cfg, dp=dp)
            assert time.perf_counter() - start < 2.0, (name, dp)


@pytest.mark.parametrize("kwargs, match", [
    ({"dp": 32, "ep": 3}, "ep=3"),
    ({"dp": 8, "ep": 16}, "ep=16"),
    ({"dp": 0}, "dp"),
    ({"dp": 8, "max_tokens": 0}, "max_tokens"),
    ({"dp": 8, "backend": "mpi"}, "backend"),
    ({"dp": 8, "gpu_memory_gib": 0}, "gpu_memory_gib"),
    ({"dp": 8, "gpu_memory_gib": float("inf")}, "gpu_memory_gib"),
    ({"dp": 8, "gpu_memory_gib": float("nan")}, "gpu_memory_gib"),
    ({"dp": 8, "seed": -1}, "seed"),
    ({"dp": True}, "dp"),
])
def test_plan_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_plan(R1, **kwargs)


def test_simulate_loads_bad_arguments():
    router = SimulatedRouter(PRESETS["mixtral-8x7b"])
    with pytest.raises(ValueError, match="ep=3"):
        simulate_loads(router, ep=3, num_tokens=10, inputs="zero")
    with pytest.raises(ValueError, match="inputs"):
        simulate_loads(router, ep=2, num_tokens=10, inputs="ones")


def test_config_dataclass_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError, match="field 'hidden_size'"):
        R1.hidden_size = 1  # type: ignore[misc]
    assert isinstance(R1, MoEModelConfig)


def test_planning_does_not_import_torch():
    """`plan` must answer fast: the planner and the DeepEP sizing mirrors import no torch
    (torch's import alone takes over a second on a small machine)."""
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys, vllm_moe_fixes.cli, vllm_moe_fixes.planner, vllm_moe_fixes.distributed; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    root = str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------
# EPLB rows: redundant experts placed by eplb.rebalance, beside the plan without them
# ---------------------------------------------------------------------------------------------
def test_plan_with_redundant_experts_shows_both_and_the_ll_buffer_growth():
    """DeepSeek-R1 at EP 64, low-latency, 64 redundant experts: 5 physical experts a rank
    instead of 4 (weights x 5/4), the LL RDMA hint sized for 320 experts (vLLM #57894: it grows
    with the expert count), and zero ids' busiest/mean from 8x down to 1x."""
    from vllm_moe_fixes.distributed.deepep_sizing import deepep_ll_rdma_bytes
    from vllm_moe_fixes.planner import eplb_refusal

    plan = make_plan(PRESETS["deepseek-r1"], dp=64, max_tokens=128, backend="deepep_low_latency",
                     redundant_experts=64)
    e = plan["eplb"]
    assert (plan["local_experts"], e["local_experts"], e["physical_experts"]) == (4, 5, 320)
    assert e["weight_bytes"] * 4 == plan["weight_bytes"] * 5
    assert e["deepep"]["ll_rdma_hint_bytes"] == deepep_ll_rdma_bytes(128, 7168, 64, 320)
    assert e["deepep"]["ll_rdma_hint_bytes"] > plan["deepep"]["ll_rdma_hint_bytes"]
    assert e["buffer_bytes"] > plan["buffer_bytes"]
    assert plan["loads"]["zero"]["imbalance"] == 8.0
    assert e["loads"]["zero"]["imbalance"] <= 1.01
    assert e["loads"]["random"]["imbalance"] <= plan["loads"]["random"]["imbalance"]
    assert eplb_refusal(plan) is None
    text = format_plan(plan)
    assert "EPLB: 320 physical experts" in text and "physical experts per rank" in text


def test_plan_refuses_an_eplb_placement_that_does_not_fit(capsys):
    """With 16 GiB a GPU the EPLB placement (weights 11.9 GiB + buffer 5.3 GiB) does not fit:
    the plan says why with the numbers, and the CLI prints it and exits 1."""
    from vllm_moe_fixes.cli import main
    from vllm_moe_fixes.planner import eplb_refusal

    args = ["plan", "--model", "deepseek-r1", "--dp", "64", "--max-tokens", "128",
            "--backend", "deepep_low_latency", "--redundant-experts", "64",
            "--gpu-memory-gib", "16"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "refused: the EPLB placement does not fit" in err
    assert "weights 11.90 GiB, all-to-all buffer 5.31 GiB" in err and "vs 16 GiB" in err
    plan = make_plan(PRESETS["mixtral-8x7b"], dp=2, redundant_experts=2)
    assert plan["eplb"]["local_experts"] == 5 and eplb_refusal(plan) is None


@pytest.mark.parametrize("redundant, match", [
    (32, r"256 \+ 32 = 288 physical experts do not divide over ep=64"),
    (-1, "redundant_experts=-1 must be an int >= 0"),
    (True, "redundant_experts=True must be an int >= 0"),
])
def test_plan_bad_redundant_experts(redundant, match):
    with pytest.raises(ValueError, match=match):
        make_plan(PRESETS["deepseek-r1"], dp=64, redundant_experts=redundant)


def test_plan_without_redundant_experts_has_no_eplb_part():
    plan = make_plan(PRESETS["mixtral-8x7b"], dp=2)
    assert plan["eplb"] is None and "EPLB" not in format_plan(plan)
