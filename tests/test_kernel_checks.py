"""The layer call's argument checks (fused_moe/kernel_checks.py), table-driven: each bad argument
raises a ValueError naming it and the rule."""

import pytest
import torch
from _layer import make_problem, new_kernel, run

from vllm_moe_fixes.fused_moe import kernel_checks
from vllm_moe_fixes.fused_moe.kernel_checks import check_weights_finite
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK


def test_bad_arguments():
    kernel = new_kernel()
    p = make_problem(4, 2, 8, 128, 256)

    def bad(match, **changes):
        q = dict(p, **{k: v for k, v in changes.items() if k in p})
        kw = {k: v for k, v in changes.items() if k not in p}
        with pytest.raises(ValueError, match=match):
            run(kernel, q, kw.pop("E", 8), **kw)

    x, w1, w2 = p["hidden_states"], p["w1"], p["w2"]
    bad("hidden_states", hidden_states=x.float())
    bad("hidden_states", hidden_states=x[None])
    bad("contiguous channels", hidden_states=x.t().contiguous().t())
    bad("w1", w1=w1.view(torch.uint8))
    bad("w1", w1=w1[:, :, :128])
    bad("w2", w2=w2[:, :, :64])
    bad("w2", w2=w2[:4])
    bad("w1_scale", w1_scale=p["w1_scale"][:, :1])
    bad("w2_scale", w2_scale=p["w2_scale"].double())
    bad("topk_ids", topk_ids=p["topk_ids"].short())
    bad("topk_ids", topk_ids=p["topk_ids"].float())
    bad("topk_ids", topk_ids=p["topk_ids"][:3])
    bad("topk_weights", topk_weights=p["topk_weights"].bfloat16())
    bad("topk_weights", topk_weights=p["topk_weights"][:, :1])
    bad("global_num_experts", E=16)
    bad("expert_map", expert_map=torch.arange(8))  # int64
    bad("expert_map", expert_map=torch.arange(4, dtype=torch.int32))
    bad("activation", activation="gelu")
    bad("apply_router_weight_on_input needs topk == 1", apply_router_weight_on_input=True)
    bad("must be a torch.Tensor", w1_scale=None)
    bad(r"w1_scale must be float32 \(8, 2, 2\)", w1_scale=torch.ones(8, 3, 2))  # exact shape
    bad("max_tokens_across_ranks", max_tokens_across_ranks=3)
    bad("max_tokens_across_ranks", max_tokens_across_ranks=4.0)
    ids = p["topk_ids"].clone()
    ids[2, 1] = 8
    bad(r"topk_ids must hold expert ids in \[-1, 8\).*topk_ids\[2, 1\] = 8", topk_ids=ids)
    ids[2, 1] = -2
    bad(r"topk_ids\[2, 1\] = -2", topk_ids=ids.int())
    emap = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8], dtype=torch.int32)
    bad(r"expert_map must hold local ids in \[-1, 8\).*expert_map\[7\] = 8", expert_map=emap)


@pytest.mark.parametrize("M, given", [(1, True), (0, False)])
def test_max_tokens_across_ranks_refuses_a_bool(M, given):
    """A bool is an int to Python; as a token count it is a slip (True would be 1)."""
    with pytest.raises(ValueError, match=rf"max_tokens_across_ranks .*not a bool.*got {given}"):
        run(new_kernel(), make_problem(M, 2, 8, 128, 256), 8, max_tokens_across_ranks=given)


@pytest.mark.parametrize("I,K", [(96, 256), (128, 200), (192, 128), (64, 64)])
def test_sizes_not_multiples_of_128_refused(I, K):
    """No backend runs such a layer: validation says so before anything runs."""
    E, M = 4, 3
    w1 = torch.zeros(E, 2 * I, K).to(FP8_DTYPE)
    w2 = torch.zeros(E, K, I).to(FP8_DTYPE)
    cdiv = lambda a: -(-a // SCALE_BLOCK)  # noqa: E731
    p = dict(hidden_states=torch.randn(M, K).bfloat16(), w1=w1, w2=w2,
             topk_weights=torch.ones(M, 1), topk_ids=torch.zeros(M, 1, dtype=torch.int64),
             w1_scale=torch.ones(E, cdiv(2 * I), cdiv(K)), w2_scale=torch.ones(E, cdiv(K), cdiv(I)),
             expert_map=None)
    with pytest.raises(ValueError, match=rf"K={K} and intermediate size I={I} must be multiples "
                                         r"of 128"):
        run(new_kernel(), p, E)


def _fp8_nan_weights(p, name, where):
    """p with a NaN (FP8 bit pattern 0x7F) at `where` of weight `name`, written in place."""
    w = p[name].clone()
    w.view(torch.uint8)[where] = 0x7F
    return dict(p, **{name: w})


@pytest.mark.parametrize("name, where, value", [
    ("w1", (1, 17, 130), float("nan")), ("w2", (7, 0, 3), float("nan")),
    ("w1_scale", (0, 1, 1), float("inf")), ("w2_scale", (3, 1, 0), float("nan"))])
def test_weights_finite_names_the_first_bad_entry(name, where, value):
    p = make_problem(4, 2, 8, 128, 256)
    weights = {n: p[n] for n in ("w1", "w1_scale", "w2", "w2_scale")}
    check_weights_finite(**weights)
    if name.endswith("scale"):
        weights[name] = weights[name].clone()
        weights[name][where] = value
    else:
        weights[name] = _fp8_nan_weights(p, name, where)[name]
    at = ", ".join(map(str, where))
    shown = "nan" if value != value else "inf"
    with pytest.raises(ValueError, match=rf"{name} must be finite .*{name}\[{at}\] = {shown}"):
        check_weights_finite(**weights)


def test_weights_are_read_once_per_tensor_version(monkeypatch):
    p = make_problem(4, 2, 8, 128, 256)
    reads = []
    inner = kernel_checks._finite
    monkeypatch.setattr(kernel_checks, "_finite", lambda t: reads.append(t) or inner(t))
    w1, s1 = p["w1"].clone(), p["w1_scale"].clone()
    check_weights_finite(w1=w1, w1_scale=s1)
    assert [t is w for t, w in zip(reads, (w1, s1))] == [True, True]
    check_weights_finite(w1=w1, w1_scale=s1)
    assert len(reads) == 2  # unchanged tensors: nothing read
    w1.view(torch.uint8)[0, 0, 0] = 0xFF  # an in-place write: a new version, read again
    with pytest.raises(ValueError, match=r"w1\[0, 0, 0\] = nan"):
        check_weights_finite(w1=w1, w1_scale=s1)
    assert len(reads) == 3
    with torch.inference_mode():  # no version to compare: read at every call
        s_inf = p["w1_scale"].clone()
    check_weights_finite(w1_scale=s_inf)
    check_weights_finite(w1_scale=s_inf)
    assert len(reads) == 5


@pytest.mark.parametrize("name", ["w1", "w2"])
def test_layer_refuses_nan_in_fp8_weights_when_checking(name, monkeypatch):
    monkeypatch.setenv("VLLM_MOE_CHECK_FINITE", "1")
    p = _fp8_nan_weights(make_problem(4, 2, 8, 128, 256), name, (0, 5, 7))
    with pytest.raises(ValueError, match=rf"{name} must be finite"):
        run(new_kernel(), p, 8)


def test_each_broken_argument_is_refused_by_its_rule():
    """check_layer_call accepts the valid call and refuses each broken one below with the rule
    that argument breaks (the message names it)."""
    p = make_problem(3, 2, 4, 128, 256)
    args = dict(x=p["hidden_states"], w1=p["w1"], w2=p["w2"], topk_weights=p["topk_weights"],
                topk_ids=p["topk_ids"], w1_scale=p["w1_scale"], w2_scale=p["w2_scale"],
                global_num_experts=4, expert_map=None, activation="silu",
                apply_router_weight_on_input=False, max_tokens_across_ranks=None)

    def check(a):
        a = dict(a)
        kernel_checks.check_layer_call(a.pop("x"), a.pop("w1"), a.pop("w2"),
                                       a.pop("topk_weights"), a.pop("topk_ids"), **a)

    check(args)
    x, w1, w2 = args["x"], args["w1"], args["w2"]
    w1s, w2s, tw, ti = (args[n] for n in ("w1_scale", "w2_scale", "topk_weights", "topk_ids"))
    broken = [
        ("x", x.float(), r"hidden_states must be bfloat16 \[M, K\]"),
        ("x", x[None], r"hidden_states must be bfloat16 \[M, K\]"),
        ("x", x[:, :128], r"w1 must be \[E_l, 2I, K=128\]"),
        ("x", x.t().contiguous().t(), "hidden_states must have contiguous channels"),
        ("w1", w1[:, :128], r"hidden size K=256 and intermediate size I=64 must be multiples"),
        ("w1", w1.float(), "w1 must be float8_e4m3fn"),
        ("w2", w2[:, :128], "w2 must be float8_e4m3fn"),
        ("w2", w2.transpose(1, 2).contiguous().transpose(1, 2), "w1 and w2 must be contiguous"),
        ("w1_scale", w1s[:, :1], r"w1_scale must be float32 \(4, 2, 2\)"),
        ("w1_scale", w1s.double(), r"w1_scale must be float32 .* got torch.float64"),
        ("w2_scale", w2s[:, :, :0], r"w2_scale must be float32 \(4, 2, 1\)"),
        ("topk_weights", tw[:, :1], r"topk_weights must be float32 \(3, 2\)"),
        ("topk_ids", ti.float(), "topk_ids must be int32 or int64"),
        ("topk_ids", ti[:2], r"topk_ids must be int32 or int64 \[M=3, k\]"),
        ("topk_ids", ti[:, :0], "topk_ids must have k >= 1 columns"),
        ("global_num_experts", 3, "global_num_experts must be an int >= E_l=4, got 3"),
        ("global_num_experts", 5, "without expert_map every expert is local"),
        ("global_num_experts", True, "global_num_experts must be an int >= E_l=4, got True"),
        ("global_num_experts", 4.0, "global_num_experts must be an int >= E_l=4, got 4.0"),
        ("expert_map", torch.arange(4), r"expert_map must be int32 \[4\], got torch.int64"),
        ("expert_map", torch.arange(5, dtype=torch.int32), r"expert_map must be int32 \[4\]"),
        ("activation", "gelu", "activation must be 'silu', got 'gelu'"),
        ("apply_router_weight_on_input", True, "needs topk == 1, got topk=2"),
        ("max_tokens_across_ranks", 2, "max_tokens_across_ranks must be None or an int"),
        ("max_tokens_across_ranks", True, r"max_tokens_across_ranks .*got True"),
        ("max_tokens_across_ranks", 3.0, r"max_tokens_across_ranks .*got 3.0"),
        ("w2_scale", [1.0], "w2_scale must be a torch.Tensor"),
        ("topk_weights", tw.to("meta"), r"must be on one device, got \['cpu', 'meta'\]"),
    ]
    for name, value, match in broken:
        with pytest.raises(ValueError, match=match):
            check({**args, name: value})

