"""DeepEP sizing mirrors (pinned values, DeepEP's own hints where it imports) and buffer building."""

import os

import pytest
import torch.distributed as dist
from _dist import run_distributed

from vllm_moe_fixes._compat import deep_ep as compat
from vllm_moe_fixes.distributed import buffers, deepep_sizing
from vllm_moe_fixes.distributed.buffers import make_all2all_buffer
from vllm_moe_fixes.distributed.deepep_sizing import (
    check_deepep_config,
    check_high_throughput_config,
    check_low_latency_config,
    deepep_buffer_footprint_bytes,
    deepep_ll_rdma_bytes,
    deepep_nvl_bytes,
    deepep_rdma_bytes,
)
from vllm_moe_fixes.distributed.torch_buffer import TorchAll2AllBuffer


def test_ll_hint_pinned():
    # The contract's example, and the arithmetic spelled out for another shape.
    assert deepep_ll_rdma_bytes(128, 7168, 2, 256) == 1_908_410_496
    n, h, e = 256, 4096, 64
    dispatch, combine = 16 + 2 * h, 4 * (h // 128) + 2 * h
    send, recv = max(n * dispatch, e * n * combine), e * n * max(dispatch, combine)
    total = 2 * (send + recv + 256)
    assert deepep_ll_rdma_bytes(n, h, 8, e) == (total + 128) // 128 * 128
    assert deepep_ll_rdma_bytes(n, h, 8, e) == deepep_ll_rdma_bytes(n, h, 64, e)  # R unused
    assert deepep_ll_rdma_bytes(1, 2048, 1, 1) % 128 == 0


def test_normal_mode_hints_pinned():
    # R=2, H=7168 bf16: 10 channels x 2 peers, 256 queued tokens each, of 14336 + 8 + 2048 bytes.
    slots, tokens = 10 * 2, 10 * 2 * 256
    raw = slots * 5 * 4 + tokens * (14336 + 8 + 1024 + 512 + 512)
    assert deepep_nvl_bytes(7168, 2) == (raw + 127) // 128 * 128 == 83_927_552
    assert deepep_rdma_bytes(7168, 2) == deepep_rdma_bytes(7168, 8) == 0
    # 16 ranks: two RDMA nodes; dispatch's rdma chunk 128 rounds up to 140 (multiple of 20).
    cfg = deepep_sizing.get_dispatch_config(16)
    assert cfg.num_max_rdma_chunked_recv_tokens == 140
    slots = 10 * 2
    raw = slots * 18 * 2 * 4 + slots * 140 * (14336 + 8 + 1024 + 512 + 512 + 16) * 2
    assert cfg.get_rdma_buffer_size_hint(14336, 16) == (raw + 127) // 128 * 128
    assert deepep_rdma_bytes(7168, 16) >= cfg.get_rdma_buffer_size_hint(14336, 16)


def test_rdma_hint_at_64_ranks_matches_deep_ep():
    # DeepEP v1.2.1 at 64 ranks, H=7168 (bf16 rows): dispatch (20, 288, 28, 128) and combine
    # (1, 288, 20, 128) both round the RDMA chunk to 140 tokens: 10 channels x 8 RDMA nodes.
    assert deepep_sizing.get_dispatch_config(64).num_max_rdma_chunked_recv_tokens == 140
    assert deepep_sizing.get_combine_config(64).num_max_rdma_chunked_recv_tokens == 140
    per_token = (14336 + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16) * 2
    assert 80 * 18 * 2 * 4 + 80 * 140 * per_token == 367_550_720
    assert deepep_rdma_bytes(7168, 64) == 367_550_720


def test_tables_are_v1_2_1s():
    """Every v1.2.1 rank count, and no other, has a config; the chunks are v1.2.1's."""
    assert deepep_sizing.CONFIG_RANKS == (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
    def chunks(c):
        return (c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
                c.num_max_rdma_chunked_send_tokens)

    assert chunks(deepep_sizing.get_dispatch_config(24)) == (8, 288, 32)
    assert chunks(deepep_sizing.get_dispatch_config(128)) == (20, 560, 32)
    assert chunks(deepep_sizing.get_combine_config(128)) == (1, 560, 12)
    for r in (1, 6, 12, 48, 96, 256):
        with pytest.raises(ValueError, match=rf"num_ranks={r} has no tuned DeepEP v1.2.1 config; "
                                             r"supported: 2, 4, 8, 16, 24, 32, 64, 128, 144, 160"):
            deepep_sizing.get_dispatch_config(r)
        with pytest.raises(ValueError, match="supported"):
            deepep_nvl_bytes(7168, r)
    with pytest.raises(ValueError, match="multiple of 8"):
        deepep_sizing.get_dispatch_config(16).get_nvl_buffer_size_hint(14336, 12)
    # DeepEP's Config assertions: nvl send < nvl recv; rdma send <= half the rounded rdma recv.
    with pytest.raises(ValueError, match="nvl send < nvl recv"):
        deepep_sizing.Config(20, 256, 256, 6, 128)
    with pytest.raises(ValueError, match="half"):
        deepep_sizing.Config(20, 6, 256, 128, 128)
    assert deepep_sizing.Config(20, 6, 256, 100, 128).num_max_rdma_chunked_recv_tokens == 200
def test_low_latency_refusals():
    assert check_low_latency_config(128, 7168, 2, 256) == 1_908_410_496
    with pytest.raises(ValueError, match=r"hidden=7000 is not supported.*2048"):
        check_low_latency_config(128, 7000, 2, 256)
    with pytest.raises(ValueError, match=r"hidden=3072 is not supported.*2560, 4096"):
        check_low_latency_config(128, 3072, 2, 256)
    with pytest.raises(ValueError, match="num_experts=250 is not divisible by the number of ranks 8"):
        check_low_latency_config(128, 7168, 8, 250)
    with pytest.raises(ValueError, match=r"2 \* 3 = 6 must be a multiple of 4"):
        check_low_latency_config(3, 7168, 2, 256)
    with pytest.raises(ValueError,
                       match="num_ranks=12: DeepEP needs fewer than 8 ranks or a multiple of 8"):
        check_low_latency_config(128, 7168, 12, 240)
    with pytest.raises(ValueError, match="positive"):
        check_low_latency_config(0, 7168, 2, 256)
    # Any rank count below 8 or a multiple of 8, with no upper limit and no 32-bit buffer limit.
    for r in (1, 3, 5, 7, 8, 24, 48, 96, 256):
        need = check_low_latency_config(4, 2048, r, 8 * r)
        assert need == deepep_ll_rdma_bytes(4, 2048, r, 8 * r)
    assert check_low_latency_config(4096, 7168, 2, 256) > 2**35


def test_high_throughput_refusals():
    nvl = 2**30
    assert check_high_throughput_config(7168, 8, 256, nvl) == 0
    assert check_high_throughput_config(7168, 64, 256, nvl) == 367_550_720
    with pytest.raises(ValueError,
                       match="num_ranks=24: DeepEP v1.2.1 has high-throughput kernels for 2, 4, 8"):
        check_high_throughput_config(7168, 24, 240, nvl)
    with pytest.raises(ValueError, match="num_ranks=48 has no tuned"):
        check_high_throughput_config(7168, 48, 240, nvl)
    with pytest.raises(ValueError, match=r"hidden=4097.*hidden % 16 == 0"):
        check_high_throughput_config(4097, 8, 256, nvl)
    with pytest.raises(ValueError, match="= 256 local experts; .* at most 128 on 2 ranks"):
        check_high_throughput_config(7168, 2, 512, nvl)
    with pytest.raises(ValueError,
                       match="VLLM_DEEPEP_BUFFER_SIZE_MB=8 gives 8388608 NVLink bytes; DeepEP needs"):
        check_high_throughput_config(7168, 2, 8, 8 * 2**20)
    # Internode: the NVLink buffer must stay below 2**31 - 1 bytes; intranode may be larger.
    with pytest.raises(ValueError,
                       match=r"VLLM_DEEPEP_BUFFER_SIZE_MB=2048 .* internode \(16 ranks\)"):
        check_high_throughput_config(7168, 16, 256, 2048 * 2**20)
    assert check_high_throughput_config(7168, 16, 256, 2047 * 2**20) > 0
    assert check_high_throughput_config(7168, 8, 256, 4096 * 2**20) == 0
    with pytest.raises(ValueError, match="not a DeepEP backend"):
        check_deepep_config("naive", num_ranks=2, max_tokens_per_rank=8, hidden=7168, num_experts=8,
                            nvl_bytes=nvl)


def test_footprint_model():
    hint = deepep_ll_rdma_bytes(128, 7168, 1, 32)
    assert hint == 238_551_424  # 227.5 MiB
    # The H200 measurements at world size 1 (benchmarks/results/deepep_footprint.json), in MiB:
    # RDMA buffers that fit in NVSHMEM's first heap step cost 2882 whatever their size; larger
    # ones get their own mapping in 512 MiB steps beside it.
    MiB = 2**20
    for n, h, e, measured in ((4, 2048, 2, 2882), (128, 7168, 32, 2882), (128, 7168, 64, 2882),
                              (128, 7168, 70, 3394), (128, 7168, 72, 3394),
                              (128, 7168, 76, 3906), (128, 7168, 144, 3906),
                              (128, 7168, 256, 4930), (256, 7168, 256, 6978)):
        model = deepep_buffer_footprint_bytes(0, deepep_ll_rdma_bytes(n, h, 1, e))
        assert model == measured * MiB, (n, h, e, model / MiB, measured)
    # One byte past a heap step costs another step.
    base = deepep_buffer_footprint_bytes(0, 2**30)
    assert deepep_buffer_footprint_bytes(0, 2**30 + 128) == base + 2**29
    # Intranode high throughput: no NVSHMEM; the NVLink buffer in 2 MiB pages plus the workspace.
    assert deepep_buffer_footprint_bytes(2**30, 0) == 2**30 + 2 * 2**20 + 32 * 2**20


@pytest.fixture
def gloo_world1(tmp_path):
    # A file store in the test's own directory: no port to race for with concurrent runs.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    buffers._BUFFERS.clear()
    yield dist.group.WORLD
    buffers._BUFFERS.clear()
    dist.destroy_process_group()


def test_make_naive_buffer_cached(gloo_world1, monkeypatch):
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "naive")
    sizes = dict(max_tokens_per_rank=64, hidden=2048, num_experts=8)
    buf = make_all2all_buffer(None, None, **sizes)
    assert isinstance(buf, TorchAll2AllBuffer) and buf.low_latency_mode
    assert buf.num_rdma_bytes == deepep_ll_rdma_bytes(64, 2048, 1, 8)
    assert make_all2all_buffer("naive", None, **sizes) is buf
    assert make_all2all_buffer("naive", None, **{**sizes, "max_tokens_per_rank": 128}) is not buf


def test_make_buffer_errors(gloo_world1, monkeypatch):
    sizes = dict(max_tokens_per_rank=64, hidden=7168, num_experts=8)
    with pytest.raises(ValueError, match="backend='nccl' is not known"):
        make_all2all_buffer("nccl", None, **sizes)
    with pytest.raises(ValueError, match="hidden=0"):
        make_all2all_buffer("naive", None, **{**sizes, "hidden": 0})
    with pytest.raises(ValueError, match="hidden=7000 is not supported"):
        make_all2all_buffer("deepep_low_latency", None, **{**sizes, "hidden": 7000})
    with pytest.raises(ValueError, match="num_ranks=1 has no tuned DeepEP v1.2.1 config"):
        make_all2all_buffer("deepep_high_throughput", None, **sizes)
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "bogus")
    with pytest.raises(ValueError, match="VLLM_ALL2ALL_BACKEND"):
        make_all2all_buffer(None, None, **sizes)


@pytest.mark.skipif(compat.is_available(), reason="deep_ep is installed here")
def test_deepep_backend_without_deep_ep(gloo_world1, monkeypatch):
    sizes = dict(max_tokens_per_rank=64, hidden=7168, num_experts=8)
    monkeypatch.setenv("VLLM_ALL2ALL_BACKEND", "deepep_low_latency")
    with pytest.raises(ImportError, match="VLLM_ALL2ALL_BACKEND=deepep_low_latency needs DeepEP"):
        make_all2all_buffer(None, None, **sizes)
    assert not compat.is_available()


def _high_throughput_worker(rank, world):
    sizes = dict(max_tokens_per_rank=64, hidden=7168, num_experts=8)
    os.environ["VLLM_DEEPEP_BUFFER_SIZE_MB"] = "8"
    with pytest.raises(ValueError, match=r"VLLM_DEEPEP_BUFFER_SIZE_MB=8 gives 8388608 .* needs \d+"):
        make_all2all_buffer("deepep_high_throughput", None, **sizes)
    with pytest.raises(ValueError, match="num_experts=9 is not divisible by the number of ranks 2"):
        make_all2all_buffer("deepep_high_throughput", None, **{**sizes, "num_experts": 9})
    os.environ["VLLM_DEEPEP_BUFFER_SIZE_MB"] = "1024"
    if not compat.is_available():
        with pytest.raises(ImportError, match="VLLM_ALL2ALL_BACKEND=deepep_high_throughput needs DeepEP"):
            make_all2all_buffer("deepep_high_throughput", None, **sizes)


def test_high_throughput_buffer_checks():
    run_distributed(_high_throughput_worker, 2)


@pytest.mark.deep_ep
def test_hints_match_deep_ep():
    """DeepEP's own hints (static methods: no group needed) equal the mirrors at every rank count
    v1.2.1 has a config for."""
    buffer_cls = compat.require("deepep_low_latency").Buffer
    for n in (1, 64, 128, 256):
        for h in (2048, 4096, 7168, 8192):
            for r, e in ((1, 32), (2, 32), (8, 256), (16, 256), (128, 256), (160, 320)):
                assert deepep_ll_rdma_bytes(n, h, r, e) == \
                    buffer_cls.get_low_latency_rdma_size_hint(n, h, r, e), (n, h, r, e)
    for r in deepep_sizing.CONFIG_RANKS:
        for h in (2048, 4096, 7168):
            cfgs = (buffer_cls.get_dispatch_config(r), buffer_cls.get_combine_config(r))
            nvl = max(c.get_nvl_buffer_size_hint(h * 2, r) for c in cfgs)
            rdma = max(c.get_rdma_buffer_size_hint(h * 2, r) for c in cfgs)
            assert (deepep_nvl_bytes(h, r), deepep_rdma_bytes(h, r)) == (nvl, rdma), (h, r)
    assert buffer_cls.get_dispatch_config(64).get_rdma_buffer_size_hint(7168 * 2, 64) == 367_550_720
