import os
import re

import pytest
import torch

from vllm_moe_fixes import envs

DEFAULTS = {
    "VLLM_ALL2ALL_BACKEND": "naive",
    "VLLM_USE_DEEP_GEMM": False,
    "VLLM_RANDOMIZE_DP_DUMMY_INPUTS": False,
    "VLLM_MOE_DP_CHUNK_SIZE": 256,
    "VLLM_DEEPEP_BUFFER_SIZE_MB": 1024,
    "VLLM_FUSED_MOE_CHUNK_SIZE": 8192,
    "VLLM_MOE_CHECK_IDS": False,
    "VLLM_MOE_CHECK_FINITE": False,
    "VLLM_MOE_FIXES": False,
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in DEFAULTS:
        monkeypatch.delenv(name, raising=False)


def test_registry_lists_exactly_the_documented_variables():
    assert set(envs.REGISTRY) == set(DEFAULTS)
    for var in envs.REGISTRY.values():
        assert var.help and "\n" not in var.help and var.allowed


@pytest.mark.parametrize("name,default", sorted(DEFAULTS.items()))
def test_unset_or_empty_gives_default(monkeypatch, name, default):
    assert getattr(envs, name) == default
    monkeypatch.setenv(name, "  ")
    assert getattr(envs, name) == default


def test_current_values_reads_every_variable(monkeypatch):
    monkeypatch.setenv("VLLM_MOE_DP_CHUNK_SIZE", "64")
    assert envs.current_values() == {**DEFAULTS, "VLLM_MOE_DP_CHUNK_SIZE": 64}


@pytest.mark.parametrize("name", ["VLLM_USE_DEEP_GEMM", "VLLM_RANDOMIZE_DP_DUMMY_INPUTS"])
@pytest.mark.parametrize("raw,value", [("1", True), ("0", False), ("true", True), ("FALSE", False),
                                       ("True", True), (" 1 ", True)])
def test_booleans(monkeypatch, name, raw, value):
    monkeypatch.setenv(name, raw)
    assert getattr(envs, name) is value


def test_reads_the_environment_at_access_time(monkeypatch):
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    assert envs.VLLM_USE_DEEP_GEMM is True
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    assert envs.VLLM_USE_DEEP_GEMM is False


@pytest.mark.parametrize("raw", ["naive", "deepep_high_throughput", "DeepEP_Low_Latency"])
def test_backend_values(monkeypatch, raw):
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", raw)
    assert envs.VLLM_ALL2ALL_BACKEND == raw.lower()


@pytest.mark.parametrize("name", ["VLLM_MOE_DP_CHUNK_SIZE", "VLLM_DEEPEP_BUFFER_SIZE_MB",
                                  "VLLM_FUSED_MOE_CHUNK_SIZE"])
@pytest.mark.parametrize("raw", ["512", " 512\n", "0512"])
def test_positive_ints(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    assert getattr(envs, name) == 512


BAD_VALUES = (
    [(name, raw) for name in ("VLLM_USE_DEEP_GEMM", "VLLM_RANDOMIZE_DP_DUMMY_INPUTS",
                              "VLLM_MOE_CHECK_IDS", "VLLM_MOE_CHECK_FINITE")
     for raw in ("2", "yes", "on", "-1", "tru")]
    + [(name, raw) for name in ("VLLM_MOE_DP_CHUNK_SIZE", "VLLM_DEEPEP_BUFFER_SIZE_MB",
                                "VLLM_FUSED_MOE_CHUNK_SIZE")
       for raw in ("0", "-4", "1.5", "abc", "1e3", "1_000", "+5", "\u0665", "1 000", "0x10")]
    + [("VLLM_ALL2ALL_BACKEND", "pplx")])


@pytest.mark.parametrize("name,raw", BAD_VALUES)
def test_bad_value_names_variable_value_and_allowed(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw!r}")) as err:
        getattr(envs, name)
    message = str(err.value)
    assert name in message and repr(raw) in message and envs.REGISTRY[name].allowed in message
    assert f"{name}={raw!r}" in message
    # The allowed values of each kind, spelled out.
    assert {"VLLM_USE_DEEP_GEMM": "true, false", "VLLM_RANDOMIZE_DP_DUMMY_INPUTS": "true, false",
            "VLLM_MOE_DP_CHUNK_SIZE": "integer > 0", "VLLM_DEEPEP_BUFFER_SIZE_MB": "integer > 0",
            "VLLM_FUSED_MOE_CHUNK_SIZE": "integer > 0", "VLLM_MOE_CHECK_IDS": "true, false",
            "VLLM_MOE_CHECK_FINITE": "true, false",
            "VLLM_ALL2ALL_BACKEND": "naive, deepep_high_throughput, deepep_low_latency"}[name] in message


def test_int_spelled_with_underscore_says_digits_only(monkeypatch):
    monkeypatch.setenv("VLLM_MOE_DP_CHUNK_SIZE", "1_000")
    with pytest.raises(ValueError, match=r"VLLM_MOE_DP_CHUNK_SIZE='1_000' is not an integer "
                                         r"\(decimal digits only\); allowed: integer > 0"):
        envs.VLLM_MOE_DP_CHUNK_SIZE


def test_unknown_attribute_is_attribute_error():
    with pytest.raises(AttributeError, match="VLLM_NOT_A_VARIABLE"):
        envs.VLLM_NOT_A_VARIABLE


def test_writes_through_os_environ_seen_at_the_next_read(monkeypatch):
    """The reads go to os.environ's own mapping (no os.environ.get per read): every way of
    writing the environment through os.environ shows at the next read."""
    monkeypatch.delenv("VLLM_FUSED_MOE_CHUNK_SIZE", raising=False)
    monkeypatch.delenv("VLLM_MOE_CHECK_IDS", raising=False)
    assert envs.VLLM_FUSED_MOE_CHUNK_SIZE == 8192
    os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = "64"
    try:
        assert envs.VLLM_FUSED_MOE_CHUNK_SIZE == 64
        os.environ.update(VLLM_FUSED_MOE_CHUNK_SIZE=" 128 ")
        assert envs.VLLM_FUSED_MOE_CHUNK_SIZE == 128
        os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"] = "1_0"
        with pytest.raises(ValueError, match="VLLM_FUSED_MOE_CHUNK_SIZE='1_0'"):
            envs.VLLM_FUSED_MOE_CHUNK_SIZE
    finally:
        del os.environ["VLLM_FUSED_MOE_CHUNK_SIZE"]
    assert envs.VLLM_FUSED_MOE_CHUNK_SIZE == 8192
    os.environ.setdefault("VLLM_MOE_CHECK_IDS", "true")  # (unset above)
    assert envs.values_checked_on(torch.device("cuda")) is True
    os.environ.pop("VLLM_MOE_CHECK_IDS")
    assert envs.values_checked_on(torch.device("cuda")) is False


def test_an_environ_without_its_own_mapping_is_read_with_get(monkeypatch):
    monkeypatch.setattr(os, "environ", {"VLLM_FUSED_MOE_CHUNK_SIZE": "32"})
    assert envs.VLLM_FUSED_MOE_CHUNK_SIZE == 32
    assert envs.VLLM_MOE_CHECK_FINITE is False
