"""The stand-in for vLLM's compiled ``_C.persistent_masked_m_silu_mul_quant`` (the op between the
two masked GEMMs of vLLM's BatchedDeepGemmExperts, which bench_decode's anchor runs), on CPU:
called as vLLM 0.33's batched_deep_gemm_moe calls it, it writes the op's recipe on the valid rows
of each expert and leaves the others alone."""

import os
import subprocess
import sys

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_support")

# A fresh interpreter: the stand-in defines the _C op namespace.
CHECK = r"""
import runpy, sys, torch
runpy.run_path(sys.argv[1] + "/stand_ins/_C_stable_libtorch.py")
E, T, H, G = 3, 8, 384, 3  # H / 128 = G groups; expert 1 receives nothing, expert 2 all T rows
g = torch.Generator().manual_seed(0)
y = (torch.randn(E, T, 2 * H, generator=g) * 4).bfloat16()
y[0, 1, 5:9] = 0  # a few zeros in a group
y[0, 2, H:H + 128] = 0  # a whole group of zero products
counts = torch.tensor([5, 0, T], dtype=torch.int32)


def recipe(rows, ue8m0):
    # silu rounded to bf16, the product rounded to bf16, 1x128 groups, amax / 448 (eps 1e-10)
    gate, up = rows[:, :H], rows[:, H:]
    a = (torch.nn.functional.silu(gate) * up).float().view(-1, G, 128)
    s = a.abs().amax(-1).clamp(min=1e-10) / 448.0
    if ue8m0:  # floored at 1e-10 first, as our per_token_group_quant_fp8 (vLLM's quant recipe)
        s = torch.exp2(torch.ceil(torch.log2(s.clamp(min=1e-10))))
    q = (a / s.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(-1, H), s


for ue8m0 in (False, True):
    y_q = torch.full((E, T, H), 7.0).to(torch.float8_e4m3fn)  # poison: 7.0 where not written
    # MN-major scales, strides (T*G, 1, T), as vLLM's scales_shape_stride_dtype allocates them
    y_s = torch.empty_strided((E, T, G), (T * G, 1, T), dtype=torch.float32).fill_(-3.0)
    torch.ops._C.persistent_masked_m_silu_mul_quant(y, counts, y_q, y_s, ue8m0)
    for e in range(E):
        n = int(counts[e])
        want_q, want_s = recipe(y[e, :n], ue8m0)
        assert torch.equal(y_q[e, :n].view(torch.uint8), want_q.view(torch.uint8)), (e, ue8m0)
        assert torch.equal(y_s[e, :n], want_s), (e, ue8m0)
        assert bool((y_q[e, n:].float() == 7.0).all()) and bool((y_s[e, n:] == -3.0).all())
    assert y_s.stride() == (T * G, 1, T)
print("ok")
"""


def test_masked_silu_mul_quant_stand_in_writes_the_recipe_on_valid_rows_only():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", CHECK, SUPPORT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
