"""_compat.deep_ep tells DeepEP v1 from V2 and refuses a backend of the other generation by name,
on stand-in modules (the real libraries need GPUs: tests/test_deep_ep_real.py, _v2_real.py)."""

import types

import pytest

from vllm_moe_fixes._compat import deep_ep as compat

V1 = types.SimpleNamespace(Buffer=object)                                 # v1.2.1: no __version__
V2 = types.SimpleNamespace(Buffer=object, ElasticBuffer=object, __version__="2.1.0")


@pytest.fixture
def installed(monkeypatch):
    def install(module, why=None):
        monkeypatch.setattr(compat, "_import", lambda: module)
        monkeypatch.setattr(compat, "_import_error", lambda: why)
    return install


def test_versions_and_descriptions(installed):
    installed(V1)
    assert compat.installed_version() == 1 and compat.describe() == "DeepEP v1 (deep_ep.Buffer)"
    assert compat.require("deepep_low_latency") is V1
    assert compat.require("deepep_high_throughput") is V1
    installed(V2)
    assert compat.installed_version() == 2
    assert compat.describe() == "DeepEP V2 2.1.0 (deep_ep.ElasticBuffer)"
    assert compat.require("deepep_v2") is V2
    installed(None)
    assert compat.installed_version() is None and not compat.is_available()
    assert compat.describe() == "not installed"
    installed(None, "AssertionError: Duplicate NCCL runtime")
    assert compat.describe() == "not importable (AssertionError: Duplicate NCCL runtime)"


@pytest.mark.parametrize("module, backend, match", [
    (V1, "deepep_v2", r"VLLM_ALL2ALL_BACKEND=deepep_v2 needs DeepEP V2 .* the installed deep_ep "
                      r"is DeepEP v1 .*deepep_high_throughput, deepep_low_latency"),
    (V2, "deepep_low_latency", r"VLLM_ALL2ALL_BACKEND=deepep_low_latency needs DeepEP v1.2.1 .* "
                               r"installed deep_ep is DeepEP V2 2.1.0 .*deepep_v2"),
    (V2, "deepep_high_throughput", r"needs DeepEP v1.2.1"),
])
def test_the_other_generation_is_a_named_error(installed, module, backend, match):
    installed(module)
    with pytest.raises(compat.DeepEPVersionError, match=match) as raised:
        compat.require(backend)
    assert isinstance(raised.value, ImportError) and raised.value.name == "deep_ep"


def test_none_installed(installed):
    installed(None)
    with pytest.raises(ImportError, match=r"VLLM_ALL2ALL_BACKEND=deepep_v2 needs DeepEP V2 "
                                          r"\(deep_ep.ElasticBuffer.*not installed.*naive"):
        compat.require("deepep_v2")
    with pytest.raises(ImportError, match=r"deepep_low_latency needs DeepEP v1.2.1"):
        compat.require("deepep_low_latency")


def test_a_broken_install_says_why(installed):
    installed(None, "AssertionError: Duplicate NCCL runtime")
    with pytest.raises(ImportError, match="does not import: AssertionError"):
        compat.require("deepep_v2")


def test_unknown_backend(installed):
    installed(V2)
    with pytest.raises(ValueError, match="'naive' is not a DeepEP backend"):
        compat.require("naive")


# ----------------------------------------------------------------- deepep_v2 wired end to end
@pytest.fixture
def gloo_world1(tmp_path):
    import torch.distributed as dist

    from vllm_moe_fixes.distributed import buffers
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    buffers._BUFFERS.clear()
    yield dist.group.WORLD
    buffers._BUFFERS.clear()
    dist.destroy_process_group()


def _fake_v2(calls):
    """A DeepEP V2 module whose ElasticBuffer is TorchElasticBuffer, recording the hint calls."""
    import torch

    from vllm_moe_fixes.distributed.torch_elastic_buffer import TorchElasticBuffer

    class ElasticBuffer(TorchElasticBuffer):
        @staticmethod
        def get_buffer_size_hint(group, n, hidden, num_topk=0, use_fp8_dispatch=False, **kw):
            calls.append((n, hidden, num_topk, use_fp8_dispatch))
            return TorchElasticBuffer.get_buffer_size_hint(group, n, hidden, num_topk,
                                                           use_fp8_dispatch, **kw)

    return types.SimpleNamespace(Buffer=object, ElasticBuffer=ElasticBuffer,
                                 topk_idx_t=torch.int64, __version__="2.1.0")


def test_deepep_v2_backend_builds_an_elastic_buffer_sized_by_its_hint(gloo_world1, installed):
    import torch

    from vllm_moe_fixes.distributed import deepep_v2_sizing as v2
    from vllm_moe_fixes.distributed.buffers import make_all2all_buffer
    from vllm_moe_fixes.fused_moe import DeepEPV2PrepareAndFinalize, make_moe_kernel
    from vllm_moe_fixes.testing import moe_reference, random_fp8_moe_weights, rel_err
    calls = []
    installed(_fake_v2(calls))
    buf = make_all2all_buffer("deepep_v2", None, max_tokens_per_rank=32, hidden=256,
                              num_experts=8, num_topk=2)
    assert calls == [(32, 256, 2, True)] and buf.num_max_tokens_per_rank == 32
    assert buf.num_bytes == v2.elastic_buffer_size_hint(32, 256, num_ranks=1, num_topk=2,
                                                        use_fp8_dispatch=True)
    assert make_all2all_buffer("deepep_v2", None, max_tokens_per_rank=32, hidden=256,
                               num_experts=8, num_topk=2) is buf  # cached
    with pytest.raises(ValueError, match="at most 256 per rank"):  # refused before any build
        make_all2all_buffer("deepep_v2", None, max_tokens_per_rank=32, hidden=256,
                            num_experts=512)
    g = torch.Generator().manual_seed(5)
    w = random_fp8_moe_weights(8, 256, 128, generator=g)
    x = torch.randn(40, 256, generator=g).to(torch.bfloat16)  # > N: two chunks
    weights, ids = torch.rand(40, 8, generator=g).softmax(-1).topk(2, dim=-1)
    ref = moe_reference(x, w.w1, w.w2, weights, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale)
    for low_latency in (False, True):
        kernel = make_moe_kernel(gloo_world1, hidden_size=256, intermediate_size=128,
                                 num_experts=8, max_tokens_per_rank=32, backend="deepep_v2",
                                 low_latency=low_latency)
        pf = kernel.prepare_finalize
        assert isinstance(pf, DeepEPV2PrepareAndFinalize) and pf.do_cpu_sync is not low_latency
        out = kernel(x, w.w1, w.w2, weights, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale,
                     global_num_experts=8)
        assert rel_err(out, ref) < 0.06


def test_v1_backend_refuses_v2(gloo_world1, installed):
    from vllm_moe_fixes.distributed.buffers import make_all2all_buffer
    installed(V2)
    with pytest.raises(compat.DeepEPVersionError, match="deepep_low_latency needs DeepEP v1"):
        make_all2all_buffer("deepep_low_latency", None, max_tokens_per_rank=32, hidden=2048,
                            num_experts=8)
