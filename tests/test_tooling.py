"""The tooling around the library: the CLI without torch, demo messages that say where a number
came from and what ran, benchmarks that refuse a CPU clearly, bench_eplb_layer's CPU smoke run, the
EPLB simulation's figure, device_run.sh failing when nothing was tested, and the README's set-up."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from vllm_moe_fixes import envs
from vllm_moe_fixes.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs ``python -m vllm_moe_fixes ARGS`` in a process where ``import torch`` fails as it does
# where torch is not installed (a meta-path finder ahead of every other).
_WITHOUT_TORCH = textwrap.dedent("""
    import runpy, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    sys.argv[0] = "vllm_moe_fixes"
    runpy.run_module("vllm_moe_fixes", run_name="__main__", alter_sys=True)
""")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in envs.REGISTRY}
    env.update(extra)
    return env


def _without_torch(*argv):
    return subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *argv], cwd=REPO,
                          env=_clean_env(), capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in envs.REGISTRY:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------ without torch
def test_check_without_torch_says_what_is_missing():
    res = _without_torch("check")
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 2, res.stdout + res.stderr
    assert re.search(r"^torch\s+not installed", res.stdout, re.M), res.stdout
    assert "problems:" in res.stdout and "pip install torch" in res.stdout
    # what needs no torch is still reported
    for word in ("python", "deep_ep", "deep_gemm", *envs.REGISTRY):
        assert word in res.stdout


@pytest.mark.parametrize("argv", [["demo"], ["bench"], ["tiny-checkpoint", "/nonexistent/tiny"]])
def test_demo_bench_and_tiny_checkpoint_without_torch_are_usage_errors(argv):
    res = _without_torch(*argv)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"error: {argv[0]} needs torch, which is not installed" in res.stderr
    assert "pip install torch" in res.stderr


def test_plan_without_torch_still_plans():
    res = _without_torch("plan", "--model", "mixtral-8x7b", "--dp", "2")
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------ demo messages
def test_demo_names_where_the_expert_count_came_from(capsys):
    """Before the fix: "--experts (8) must be a multiple of --world-size (16)", with no
    --experts given."""
    assert main(["demo", "--model", "mixtral-8x7b", "--world-size", "16"]) == 2
    err = capsys.readouterr().err
    assert "E=8 experts (from --model mixtral-8x7b) must be a multiple of --world-size (16)" \
        in err, err
    assert main(["demo", "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "E=16 experts (the default of --experts) must be a multiple of --world-size (3)" \
        in err, err
    assert main(["demo", "--experts", "6", "--world-size", "4"]) == 2
    assert "E=6 experts (from --experts) must be a multiple of --world-size (4)" \
        in capsys.readouterr().err
    assert main(["demo", "--topk", "17"]) == 2
    assert "--topk must be <= E=16 (the default of --experts), got 17" in capsys.readouterr().err


def test_cpu_demo_prints_what_ran(capsys):
    """Before the fix the CPU demo printed "TritonExperts" alone, though CPU tensors run the
    torch reference of every op."""
    assert main(["demo", "--cpu", "--reps", "0", "--tokens", "4", "--hidden", "256",
                 "--experts", "4", "--topk", "2", "--intermediate", "128"]) == 0
    out = capsys.readouterr().out
    assert "ran: the torch reference of every op (CPU tensors;" in out, out


@pytest.mark.gpu
def test_gpu_demo_prints_what_ran(capsys):
    assert main(["demo", "--reps", "0", "--tokens", "4", "--hidden", "256", "--experts", "4",
                 "--topk", "2", "--intermediate", "128"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ran: the Triton kernels, with (Triton|DeepGEMM's) grouped FP8 GEMMs", out)


# ------------------------------------------------------------------ model files
def test_plan_with_a_model_file_that_is_not_utf8_names_the_file(tmp_path, capsys):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"name": "caf\xe9"}'.encode("latin-1"))
    assert main(["plan", "--model", str(path), "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert f"cannot read model config '{path}'" in err and "UTF-8" in err, err


_FIELDS = ('"hidden_size": 1024, "moe_intermediate_size": 256, "top_k": 2, "vocab_size": 100, '
           '"num_layers": 2')


@pytest.mark.parametrize("text, says", [
    ('{"num_experts": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper"),
    ("{" + _FIELDS + ', "num_experts": ' + "7" * 5001 + "}",
     "num_experts must be an int in [1, 1024], got an integer of 5001 digits")])
def test_plan_with_a_deep_or_huge_model_file_names_the_file_and_field(tmp_path, capsys, text,
                                                                      says):
    """Python's JSON parser raises RecursionError past its nesting limit, and int() refuses more
    than 4300 digits naming neither file nor field: plan says both, as a usage error."""
    path = tmp_path / "model.json"
    path.write_text(text)
    assert main(["plan", "--model", str(path), "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert f"model config '{path}'" in err and says in err, err


# ------------------------------------------------------------------ benchmarks on a CPU
@pytest.mark.parametrize("module", ["bench_quant", "bench_moe_sum", "bench_grouped_topk",
                                    "bench_experts", "bench_grouped_gemm"])
def test_gpu_benchmarks_refuse_a_cpu_clearly(module):
    """bench_quant, bench_moe_sum and bench_grouped_topk crashed with torch tracebacks on a
    CPU; every GPU benchmark now refuses before it starts."""
    res = subprocess.run([sys.executable, "-m", f"benchmarks.{module}"], cwd=REPO,
                         env=_clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    assert f"{module} needs a CUDA GPU" in res.stderr, res.stderr


def test_eplb_layer_benchmark_smoke_runs_on_a_cpu():
    """bench_eplb_layer --smoke: tiny shapes on the CPU, every row of the table and the layer-time
    sweep printed, no JSON written."""
    res = subprocess.run([sys.executable, "-m", "benchmarks.bench_eplb_layer", "--smoke"],
                         cwd=REPO, env=_clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True,
                         text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("balanced", "zeros + eplb", "zipf + eplb", "tokens_per_rank"):
        assert name in res.stdout, res.stdout
    assert "wrote" not in res.stdout


def test_plots_draw_the_eplb_simulation_figure(tmp_path):
    """benchmarks/plots.py gives eplb_sim.json its own figure (max/mean against R, a panel per
    scenario and EP size), drawn where matplotlib is installed."""
    rows = [{"scenario": s, "ep": ep, "redundant": r,
             "measured": {"none": 4.0, "baseline": 2.0 - r / 64, "ours": 1.5 - r / 64}}
            for s in ("zero", "shift") for ep, r in ((8, 0), (8, 64), (64, 0))]
    (tmp_path / "eplb_sim.json").write_text(json.dumps({"rows": rows}))
    res = subprocess.run([sys.executable, "-m", "benchmarks.plots", str(tmp_path)], cwd=REPO,
                         env=_clean_env(), capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "eplb_sim.json: max/mean rank load against redundant experts" in res.stdout
    drawn = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "eplb_sim.png").is_file() == drawn, res.stdout + res.stderr


# ------------------------------------------------------------------ the GPU selection on a CPU
@pytest.mark.parametrize("markexpr, gpu_only", [
    ("gpu or multi_gpu", True), ("(gpu or deep_gemm) and deep_ep", True), ("gpu", True),
    ("not gpu", False), ("gpu or slow", False), ("", False)])
def test_which_marker_expressions_select_gpu_tests_only(markexpr, gpu_only):
    import conftest
    assert conftest._selects_gpu_tests_only(markexpr) is gpu_only


def test_gpu_selection_where_every_test_skips_fails():
    """pytest alone exits 0 when every selected test skips: the README's GPU command 'passed' on
    a CPU having run nothing. tests/conftest.py fails such a run (exit status 5). No GPU is
    visible to the run, so its GPU tests skip on any machine."""
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                          "gpu or multi_gpu", "tests/test_moe_sum.py"], cwd=REPO,
                         env=_clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True,
                         text=True, timeout=300, check=False)
    assert res.returncode == 5, res.stdout[-2000:]
    assert "no test of -m 'gpu or multi_gpu' ran" in res.stdout, res.stdout[-2000:]
    assert re.search(r"\d+ skipped", res.stdout), res.stdout[-2000:]


# ------------------------------------------------------------------ device_run.sh
_SKIPPED = "import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n    pytest.skip('no GPU')\n"
_PASSED = "import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n    pass\n"


def _device_tree(tmp_path, *, build_ok, test_source):
    """A checkout holding device_run.sh, a stand-in device_build.sh, one GPU test and, when the
    build 'succeeded', stand-in deep_ep / deep_gemm packages where the built ones go; a stand-in
    nvidia-smi on PATH. Returns (root, env)."""
    root = tmp_path / "checkout"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "benchmarks", "device_run.sh"), root / "benchmarks")
    (root / "benchmarks" / "device_build.sh").write_text(
        "echo 'stand-in build'\n" + ("exit 0\n" if build_ok else "echo 'no nvcc'; exit 1\n"))
    (root / "tests").mkdir()
    (root / "tests" / "test_gpu.py").write_text(test_source)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: x\n    multi_gpu: x\n"
                                     "    deep_ep: x\n    deep_gemm: x\n")
    if build_ok:  # what a successful build leaves: the extensions and importable packages
        ep, gemm = root / ".deps" / "DeepEP", root / ".deps" / "DeepGEMM" / "deep_gemm"
        gemm.mkdir(parents=True)
        ep.mkdir(parents=True, exist_ok=True)
        (ep / "deep_ep_cpp.so").write_text("")
        (ep / "deep_ep.py").write_text("")
        (gemm / "_C.so").write_text("")
        (gemm / "__init__.py").write_text("__version__ = 'stand-in'\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = _clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"))
    env.pop("PYTHONPATH", None)
    return root, env


def _device_run_tests(root, env):
    return subprocess.run(["bash", "benchmarks/device_run.sh", "tests"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("build_ok, test_source, ok", [
    (False, _SKIPPED, False),  # the case: the build failed and every test skipped
    (False, _PASSED, False),   # a failed build fails the stage even when tests pass
    (True, _SKIPPED, False),   # built, but no GPU test ran
    (True, _PASSED, True),
], ids=["build-failed-all-skipped", "build-failed-passed", "built-all-skipped", "built-passed"])
def test_device_run_tests_fails_when_the_build_failed_or_nothing_ran(tmp_path, build_ok,
                                                                     test_source, ok):
    root, env = _device_tree(tmp_path, build_ok=build_ok, test_source=test_source)
    res = _device_run_tests(root, env)
    assert (res.returncode == 0) == ok, res.stdout + res.stderr
    if not build_ok:
        assert "build failed" in res.stdout + res.stderr
    elif not ok:
        assert "no GPU test ran" in res.stdout + res.stderr


# ------------------------------------------------------------------ README set-up
def _readme_setup():
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    return text.split("## Set-up", 1)[1].split("\n## ", 1)[0]


def test_readme_setup_says_venv_and_what_the_torch_pin_means():
    setup = _readme_setup()
    assert "virtual environment" in setup and "python3 -m venv" in setup
    assert "CUDA" in setup and "keep" in setup  # a GPU machine keeps its CUDA torch


def test_readme_uninstalls_without_asking():
    """`pip uninstall` asks once per package without -y: a copied command stops three times."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    uninstalls = re.findall(r"pip3? uninstall[^`\n]*", text)
    assert uninstalls, "the README's vLLM step uninstalls torchvision, torchaudio, torchcodec"
    assert all(re.search(r"\s(-y|--yes)\b", u) for u in uninstalls), uninstalls
