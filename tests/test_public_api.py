"""The README and docs/ against the code: public names import from where users import them, every
name and path they mention exists, the Layout section of docs/design.md lists every module, the
README's environment table says what the registry says, and their python examples run. Also: no
file of the repository points the reader to a markdown file the repository does not hold."""

import builtins
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_moe_fixes import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_moe_fixes"
README = (ROOT / "README.md").read_text()
# The pages a user reads: the README and docs/*.md (design notes, figures).
PAGES = {"README.md": README, **{f"docs/{p.name}": p.read_text()
                                 for p in sorted((ROOT / "docs").glob("*.md"))}}
DESIGN = PAGES["docs/design.md"]
# The repository's own directories (a checkout may hold others, such as sources of dependencies).
REPO_DIRS = ("vllm_moe_fixes", "tests", "benchmarks", "docs", ".ci")

PUBLIC = {
    "vllm_moe_fixes.ops": ["per_token_group_quant_fp8", "moe_sum", "silu_and_mul",
                           "silu_and_mul_quant_fp8", "grouped_fp8_gemm_contiguous",
                           "grouped_fp8_gemm_masked", "empty_mn_major_scales"],
    "vllm_moe_fixes.fused_moe": ["FusedMoEModularKernel", "DeepGemmExperts", "TritonExperts",
                                 "BatchedTritonExperts", "BatchedDeepGemmExperts",
                                 "NoEPPrepareAndFinalize", "DeepEPHTPrepareAndFinalize",
                                 "DeepEPLLPrepareAndFinalize", "Workspaces", "fused_topk",
                                 "grouped_topk", "moe_reference", "experts_for_format"],
    "vllm_moe_fixes.distributed": ["TorchAll2AllBuffer", "make_all2all_buffer",
                                   "deepep_ll_rdma_bytes", "deepep_nvl_bytes", "deepep_rdma_bytes"],
    "vllm_moe_fixes.worker": ["maybe_randomize_inputs"],
}
# Backticked class names of the README that belong to other libraries (DeepEP's deep_ep.Buffer).
FOREIGN_CLASSES = {"Buffer"}


def _section(title: str) -> str:
    """The text of docs/design.md under `## title`, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", DESIGN, re.M | re.S)
    assert match, f"docs/design.md has no '## {title}' section"
    return match.group(1)


def _backticked() -> list[str]:
    return [name for text in PAGES.values() for name in re.findall(r"`([^`\n]+)`", text)]


def _resolve(dotted: str):
    """Import the longest module prefix of `dotted`, then get the remaining attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


# ---------------------------------------------------------------- public names
@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import(module):
    mod = importlib.import_module(module)
    for name in PUBLIC[module]:
        assert callable(getattr(mod, name)), f"{module}.{name}"
        assert name in mod.__all__, f"{name} missing from {module}.__all__"


def test_readme_dotted_names_resolve():
    """`worker.maybe_randomize_inputs`, `vllm_moe_fixes.envs.X`, ...: each names a real object.
    `envs.NAME` stands for any registered variable and is checked against the registry."""
    short = "|".join(("ops", "fused_moe", "distributed", "worker", "envs"))
    names = {m.group(1) for text in _backticked()
             if (m := re.fullmatch(rf"((?:vllm_moe_fixes\.)?(?:{short})(?:\.\w+)+)", text))}
    assert names, "the README names no public object"
    for name in sorted(names):
        full = name if name.startswith("vllm_moe_fixes.") else f"vllm_moe_fixes.{name}"
        if full == "vllm_moe_fixes.envs.NAME":
            assert envs.REGISTRY
            continue
        _resolve(full)


def test_readme_class_names_import():
    """Every backticked CamelCase name (`TritonExperts()`, `TorchAll2AllBuffer`, ...) is exported
    by one of the public packages (the vLLM integration's too, whose import loads no vllm),
    unless it is a Python builtin or another library's."""
    modules = [importlib.import_module(m) for m in (*PUBLIC, "vllm_moe_fixes.eplb",
                                                      "vllm_moe_fixes.integrations.vllm")]
    names = {m.group(1) for text in _backticked()
             if (m := re.match(r"([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)(?:\(|$)", text))}
    missing = [n for n in sorted(names - FOREIGN_CLASSES) if not hasattr(builtins, n)
               and not any(n in getattr(m, "__all__", ()) for m in modules)]
    assert not missing, f"README or docs/ name classes no public package exports: {missing}"


def test_readme_paths_exist():
    """Backticked repository paths (`tests/conftest.py`, `benchmarks/results/`, globs) exist."""
    paths = [t for t in _backticked() if re.fullmatch(r"[\w.*-]+/[\w./*-]*", t)]
    assert paths
    missing = [p for p in paths if not any(ROOT.glob(p.rstrip("/")))]
    assert not missing, f"README or docs/ name paths the repository does not hold: {missing}"


# ---------------------------------------------------------------- Layout section
def _repo_files() -> list[Path]:
    """Files at the top of the checkout and under the repository's own directories."""
    files = [p for p in ROOT.iterdir() if p.is_file()]
    return files + [p for d in REPO_DIRS for p in (ROOT / d).rglob("*") if p.is_file()]


def _package_modules() -> list[Path]:
    return sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_readme_layout_lists_every_module():
    """Each module file of the package (package __init__ files aside) and each subpackage
    directory is named in the Layout section."""
    layout = _section("Layout")
    missing = [str(p) for p in _package_modules() if p.name != "__init__.py"
               and not re.search(rf"(?<![\w.]){re.escape(p.name)}(?!\w)", layout)]
    missing += [f"{p.parent}/" for p in _package_modules() if p.name == "__init__.py"
                and p.parent != Path(".") and f"{p.parent.name}/" not in layout]
    assert not missing, f"docs/design.md Layout section does not list: {missing}"


def test_readme_layout_names_only_existing_files():
    """Every file name in the Layout section exists in the repository (no stale entries)."""
    existing = {p.name for p in _repo_files()}
    named = set(re.findall(r"[\w-]+\.(?:py|json|log|toml|md)\b", _section("Layout")))
    assert not named - existing, f"docs/design.md Layout names missing files: {sorted(named - existing)}"


# ---------------------------------------------------------------- no pointers outside the repo
def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.stdout.split() if f.endswith((".py", ".md", ".toml"))
            or f.startswith(".ci/")]


def test_no_file_names_a_markdown_file_outside_the_repo():
    """Comments, docstrings and the README state facts in place or point to files in the repo:
    every `*.md` they name is a file of the repository."""
    existing = {p.relative_to(ROOT).as_posix() for p in _repo_files() if p.suffix == ".md"}
    names = {p.rsplit("/", 1)[-1] for p in existing}
    bad = []
    for path in _tracked_text_files():
        if not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for ref in re.findall(r"[\w./-]*\w\.md\b", line):
                if ref not in existing and ref not in names:
                    bad.append(f"{path.relative_to(ROOT)}:{lineno}: {ref}")
    assert not bad, "files name markdown files the repository does not hold:\n" + "\n".join(bad)


# ---------------------------------------------------------------- environment table, examples
def test_readme_environment_table_matches_registry():
    for var in envs.REGISTRY.values():
        default = {True: "1", False: "0"}.get(var.default, var.default) \
            if isinstance(var.default, bool) else var.default
        row = f"| `{var.name}` | {var.allowed} | `{default}` | {var.help} |"
        assert row in README, f"README row out of date for {var.name}:\n{row}"


def _python_blocks() -> list[tuple[str, str]]:
    """(page, code) of every python block of the README and docs/."""
    return [(page, block.split("```", 1)[0]) for page, text in PAGES.items()
            for block in text.split("```python\n")[1:]]


@pytest.mark.parametrize("page,code", _python_blocks(),
                         ids=[f"{page}-{i}" for i, (page, _) in enumerate(_python_blocks())])
def test_readme_examples_run(page, code, tmp_path):
    """Every python block of the README and docs/ runs as written (each in its own process, on
    CPU)."""
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]

