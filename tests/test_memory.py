"""peak_memory: the extra peak allocated bytes of a block, the one helper of benchmarks, tests
and the CLI."""

import pytest
import torch

from vllm_moe_fixes._memory import peak_memory

MIB = 2**20


def test_non_cuda_device_measures_nothing():
    with peak_memory("cpu") as peak:
        torch.empty(MIB, dtype=torch.uint8)
    assert peak.bytes is None


@pytest.mark.gpu
def test_gpu_peak_is_the_largest_extra_allocation_of_the_block():
    held = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")  # before the block: not counted
    with peak_memory() as peak:
        assert peak.bytes is None
        first = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
        del first  # freed: the next allocation reuses its cached block, the peak stays 3 MiB
        kept = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
    assert peak.bytes == 3 * MIB
    with peak_memory(torch.device("cuda", torch.cuda.current_device())) as peak:
        more = torch.empty(5 * MIB, dtype=torch.uint8, device="cuda")  # alive at the end: counted
    assert peak.bytes == 5 * MIB
    del held, kept, more
