"""DeepSeek-V3/R1 routing: grouped top-k on sigmoid scores with a correction bias, in one kernel.

For every token (row of the router logits, E experts in G equal groups of S = E/G)::

    score  = sigmoid(logit)                  (softmax over the row with scoring_func="softmax")
    choice = score + e_score_correction_bias (the bias steers the choice only)
    group  = sum of the 2 largest choice values of each group               [G]
    keep   = the topk_group best groups; the experts of the other groups are not eligible
    ids    = the k eligible experts of largest choice
    weight = score[ids] (unbiased), divided by sum(score[ids]) + 1e-20 when renormalize,
             then multiplied by routed_scaling_factor

Deterministic order and ties: groups and experts are ranked by value, largest first, and equal
values by index, lowest first. The k slots of a token come out in that order. A NaN choice value
(from a NaN logit, or softmax over +inf logits) ranks as -inf, so the ids are always experts of
kept groups.

Scores are computed in float64 and rounded to float32. The torch path and the kernel use
different exp implementations (SLEEF, numpy, libdevice); in float32 these differ by an ulp on
some inputs, which would flip the choice between near-equal experts. Their float64 results round
to the same float32 except with probability ~2**-29 per score, so the two paths choose the same
experts, ties included. Everything after the scores is float32 add/compare/divide, done in the
same order by both (the renormalising sum runs over the slots in order).

Kernel design: one program owns BLOCK_M tokens and holds their logits as a
[BLOCK_M, G_PAD, S_PAD] register tile (G and S padded to powers of two, so any E and group size
work: padding sits at higher indices than every real expert and group, and loses every tie).
Group scores are two axis-2 reductions; the topk_group groups and then the k experts are picked
one per step (max, then the lowest index holding it). int64 row offsets throughout.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from vllm_moe_fixes import envs
from vllm_moe_fixes._validate import check, check_bool, check_positive_int
from vllm_moe_fixes.ops.triton_utils import next_power_of_2
from vllm_moe_fixes.sizes import cdiv

__all__ = ["grouped_topk", "grouped_topk_ref", "grouped_topk_triton"]

SCORING_FUNCS = ("sigmoid", "softmax")
MAX_EXPERTS = 512  # a token's scores live in registers
# DeepSeek-V3's model code adds this to the renormalising sum (zero scores give 0, not NaN).
RENORM_EPS = 1e-20
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Launch config: about 1024 scores per program, 4 warps.
_ELEMENTS_PER_PROGRAM = 1024


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _load_scores(logits_ptr, bias_ptr, rows, M, logits_stride_m, logits_stride_e, bias_stride,
                 NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr,
                 S_PAD: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(score, choice, real) [BLOCK_M, G_PAD, S_PAD]: float32 scores, biased scores (-inf for
    NaN and padding), and the mask of real experts. Rows past M repeat row M - 1 (never stored),
    so that no padded row computes -inf - -inf."""
    group = tl.arange(0, G_PAD)[:, None]
    member = tl.arange(0, S_PAD)[None, :]
    expert = (group * GROUP_SIZE + member).to(tl.int64)                          # [G_PAD, S_PAD]
    real = ((group < NUM_GROUPS) & (member < GROUP_SIZE))[None, :, :]
    x = tl.load(logits_ptr + tl.minimum(rows, M - 1)[:, None, None] * logits_stride_m
                + expert[None, :, :] * logits_stride_e,
                mask=real, other=float("-inf")).to(tl.float64)
    # float64, rounded once to float32 (see the module docstring).
    if SOFTMAX:
        e = tl.exp(x - tl.max(tl.max(x, axis=2), axis=1)[:, None, None])
        score = (e / tl.sum(tl.sum(e, axis=2), axis=1)[:, None, None]).to(tl.float32)
    else:
        score = (1.0 / (1.0 + tl.exp(-x))).to(tl.float32)
    choice = score
    if HAS_BIAS:
        choice = score + tl.load(bias_ptr + expert[None, :, :] * bias_stride, mask=real, other=0.0)
    choice = tl.where((choice != choice) | ~real, float("-inf"), choice)
    return score, choice, real


@triton.jit
def _kept_groups(choice, pos, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr,
                 TOPK_GROUP: tl.constexpr):
    """int1 [BLOCK_M, G_PAD]: each row's TOPK_GROUP best groups (group score: its 2 largest)."""
    first = tl.max(choice, axis=2)
    first_pos = tl.min(tl.where(choice == first[:, :, None], pos[None, :, :], G_PAD * S_PAD),
                       axis=2)
    second = tl.max(tl.where(pos[None, :, :] == first_pos[:, :, None], float("-inf"), choice),
                    axis=2)
    group_score = first + second
    group = tl.arange(0, G_PAD)[None, :]
    kept = tl.zeros((BLOCK_M, G_PAD), dtype=tl.int1)
    for _ in range(TOPK_GROUP):  # padded groups (-inf, highest indices) lose every tie
        free = tl.where(kept, float("-inf"), group_score)
        best = tl.max(free, axis=1)
        pick = tl.min(tl.where((free == best[:, None]) & ~kept, group, G_PAD), axis=1)
        kept = kept | (group == pick[:, None])
    return kept


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, M, scaling,
    logits_stride_m, logits_stride_e, bias_stride, weights_stride_m, weights_stride_k,
    ids_stride_m, ids_stride_k,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOPK: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    score, choice, real = _load_scores(
        logits_ptr, bias_ptr, rows, M, logits_stride_m, logits_stride_e, bias_stride,
        NUM_GROUPS, GROUP_SIZE, G_PAD, S_PAD, SOFTMAX, HAS_BIAS)
    # A tile position's rank among equal values: padding comes after every real expert.
    pos = tl.arange(0, G_PAD)[:, None] * S_PAD + tl.arange(0, S_PAD)[None, :]
    eligible = tl.broadcast_to(real, (BLOCK_M, G_PAD, S_PAD))
    if NUM_GROUPS > 1:
        kept = _kept_groups(choice, pos, BLOCK_M, G_PAD, S_PAD, TOPK_GROUP)
        eligible = eligible & kept[:, :, None]

    # The k experts, one per step: the largest eligible choice, lowest position among equals.
    slot = tl.arange(0, K_PAD)[None, :]
    top_ids = tl.zeros((BLOCK_M, K_PAD), dtype=tl.int64)
    top_w = tl.zeros((BLOCK_M, K_PAD), dtype=tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for t in range(TOPK):
        free = tl.where(eligible, choice, float("-inf"))
        best = tl.max(tl.max(free, axis=2), axis=1)
        at_best = (free == best[:, None, None]) & eligible
        pick = tl.min(tl.min(tl.where(at_best, pos[None, :, :], G_PAD * S_PAD), axis=2), axis=1)
        hit = pos[None, :, :] == pick[:, None, None]
        w = tl.sum(tl.sum(tl.where(hit, score, 0.0), axis=2), axis=1)  # the picked score
        eligible = eligible & ~hit
        total = total + w
        expert_id = (pick // S_PAD) * GROUP_SIZE + pick % S_PAD
        top_ids = tl.where(slot == t, expert_id[:, None].to(tl.int64), top_ids)
        top_w = tl.where(slot == t, w[:, None], top_w)

    if RENORMALIZE:  # IEEE division, as torch divides (Triton's `/` may round approximately)
        top_w = tl.math.div_rn(top_w, (total + 1e-20)[:, None])
    top_w = top_w * scaling
    out_mask = (rows < M)[:, None] & (slot < TOPK)
    tl.store(weights_ptr + rows[:, None] * weights_stride_m + slot * weights_stride_k, top_w,
             mask=out_mask)
    tl.store(ids_ptr + rows[:, None] * ids_stride_m + slot * ids_stride_k, top_ids, mask=out_mask)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------
def grouped_topk_triton(gating_output: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, renormalize: bool, num_expert_group: int,
                        topk_group: int, scoring_func: str = "sigmoid",
                        e_score_correction_bias: torch.Tensor | None = None,
                        routed_scaling_factor: float = 1.0, block_m: int | None = None,
                        num_warps: int = 4) -> None:
    """Launch the kernel (CUDA, or CPU under TRITON_INTERPRET=1; arguments already validated).

    gating_output [M, E] (any strides), topk_weights float32 [M, k] and topk_ids int64 [M, k]
    (written, any strides), other arguments as `grouped_topk`. block_m (a power of two) and
    num_warps override the default launch config.
    """
    M, E = gating_output.shape
    if M == 0:
        return
    k = topk_ids.shape[1]
    group_size = E // num_expert_group
    g_pad, s_pad = next_power_of_2(num_expert_group), next_power_of_2(group_size)
    block_m = block_m or max(1, _ELEMENTS_PER_PROGRAM // (g_pad * s_pad))
    has_bias = e_score_correction_bias is not None
    bias = e_score_correction_bias if has_bias else topk_weights
    _grouped_topk_kernel[(cdiv(M, block_m),)](
        gating_output, bias, topk_weights, topk_ids, M, float(routed_scaling_factor),
        *gating_output.stride(), bias.stride(0) if has_bias else 0, *topk_weights.stride(),
        *topk_ids.stride(),
        NUM_GROUPS=num_expert_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group, TOPK=k,
        G_PAD=g_pad, S_PAD=s_pad, K_PAD=next_power_of_2(k), BLOCK_M=block_m,
        SOFTMAX=scoring_func == "softmax", HAS_BIAS=has_bias, RENORMALIZE=bool(renormalize),
        num_warps=num_warps, enable_fp_fusion=False,
    )


# ----------------------------------------------------------------------------------------------
# Torch reference (the CPU path)
# ----------------------------------------------------------------------------------------------
def _scores(gating_output: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """float32 [M, E]: sigmoid or softmax of the logits, computed in float64 and rounded once."""
    x = gating_output.double()
    probs = torch.softmax(x, dim=1) if scoring_func == "softmax" else torch.sigmoid(x)
    return probs.float()


def _rank(values: torch.Tensor, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [M, N]: column indices of each row, eligible first, then by value (largest first),
    equal values by index (lowest first). Two stable sorts: torch.topk leaves tie order open."""
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    if eligible is None:
        return order
    first = torch.sort(eligible.gather(1, order).to(torch.uint8), dim=1, descending=True,
                       stable=True).indices
    return order.gather(1, first)


def _eligible_experts(choice: torch.Tensor, num_expert_group: int, topk_group: int) -> torch.Tensor:
    """bool [M, E]: experts of each token's topk_group best groups (group score: its 2 largest)."""
    M, E = choice.shape
    grouped = torch.sort(choice.view(M, num_expert_group, E // num_expert_group), dim=2,
                         descending=True).values
    group_score = grouped[:, :, 0] + grouped[:, :, 1]
    kept_groups = _rank(group_score)[:, :topk_group]
    kept = torch.zeros(M, num_expert_group, dtype=torch.bool, device=choice.device)
    kept.scatter_(1, kept_groups, True)
    return kept.repeat_interleave(E // num_expert_group, dim=1)


def grouped_topk_ref(gating_output: torch.Tensor, topk: int, *, renormalize: bool,
                     num_expert_group: int, topk_group: int, scoring_func: str = "sigmoid",
                     e_score_correction_bias: torch.Tensor | None = None,
                     routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch path of `grouped_topk` (arguments already validated; any device)."""
    scores = _scores(gating_output, scoring_func)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    choice = choice.masked_fill(choice.isnan(), float("-inf"))
    eligible = None
    if num_expert_group > 1:
        eligible = _eligible_experts(choice, num_expert_group, topk_group)
    topk_ids = _rank(choice, eligible)[:, :topk]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        total = torch.zeros_like(topk_weights[:, 0])
        for t in range(topk):  # slot order, as the kernel sums
            total = total + topk_weights[:, t]
        topk_weights = topk_weights / (total + RENORM_EPS).unsqueeze(1)
    return topk_weights * routed_scaling_factor, topk_ids


# ----------------------------------------------------------------------------------------------
# API
# ----------------------------------------------------------------------------------------------
def _check_args(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                e_score_correction_bias, routed_scaling_factor) -> None:
    check(isinstance(gating_output, torch.Tensor) and gating_output.dim() == 2
          and gating_output.dtype in _LOGIT_DTYPES,
          f"gating_output must be a float32/bfloat16/float16 [M, E] tensor, got "
          f"{getattr(gating_output, 'dtype', type(gating_output))} "
          f"{tuple(getattr(gating_output, 'shape', ()))}")
    check(gating_output.device.type in ("cpu", "cuda"),
          f"gating_output must be on CPU or CUDA, got {gating_output.device}")
    E = gating_output.shape[1]
    check(1 <= E <= MAX_EXPERTS, f"gating_output has E={E} experts; allowed: 1..{MAX_EXPERTS}")
    check_bool("renormalize", renormalize)
    check(scoring_func in SCORING_FUNCS,
          f"scoring_func={scoring_func!r}; allowed: {', '.join(SCORING_FUNCS)}")
    check_positive_int("num_expert_group", num_expert_group)
    check(E % num_expert_group == 0,
          f"E={E} experts are not divisible by num_expert_group={num_expert_group}")
    check(num_expert_group == 1 or E // num_expert_group >= 2,
          f"groups of E/num_expert_group={E // num_expert_group} expert: a group is scored by "
          f"its 2 best experts, so each group needs at least 2 (or num_expert_group=1)")
    check_positive_int("topk_group", topk_group)
    check(topk_group <= num_expert_group,
          f"topk_group={topk_group} > num_expert_group={num_expert_group}")
    check_positive_int("topk", topk)
    eligible = topk_group * (E // num_expert_group)
    check(topk <= eligible, f"topk={topk} exceeds the {eligible} experts of the "
                            f"topk_group={topk_group} kept groups ({E // num_expert_group} each)")
    scale = routed_scaling_factor
    check(isinstance(scale, (int, float)) and not isinstance(scale, bool)
          and math.isfinite(scale) and scale > 0,
          f"routed_scaling_factor must be a finite number > 0, got {routed_scaling_factor!r}")
    bias = e_score_correction_bias
    check(bias is None or (isinstance(bias, torch.Tensor) and bias.dtype == torch.float32
                           and bias.shape == (E,) and bias.device == gating_output.device),
          f"e_score_correction_bias must be None or float32 [{E}] on {gating_output.device}, got "
          f"{getattr(bias, 'dtype', type(bias))} {tuple(getattr(bias, 'shape', ()))} "
          f"on {getattr(bias, 'device', None)}")


def _check_bias_finite(bias: torch.Tensor) -> None:
    """ValueError naming the first NaN or inf of the correction bias (such an entry would drop
    or force its expert on every token). Reads the values: a host synchronisation on CUDA."""
    bad = ~torch.isfinite(bias)
    if bool(bad.any()):
        e = int(bad.nonzero()[0, 0])
        raise ValueError(f"e_score_correction_bias must be finite; "
                         f"e_score_correction_bias[{e}] = {float(bias[e])}")


def grouped_topk(gating_output: torch.Tensor, topk: int, *, renormalize: bool,
                 num_expert_group: int, topk_group: int, scoring_func: str = "sigmoid",
                 e_score_correction_bias: torch.Tensor | None = None,
                 routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3/R1 routing: the k experts of every token, chosen within its best expert groups.

    DeepSeek-V3/R1 use scoring_func="sigmoid", num_expert_group=8, topk_group=4, topk=8,
    renormalize=True, their trained e_score_correction_bias and routed_scaling_factor=2.5.

    Args:
        gating_output: `[M, E]` router logits, `torch.float32` / `torch.bfloat16` /
            `torch.float16`, any strides, 1 <= E <= 512; CPU or CUDA.
        topk: k, 1 <= k <= topk_group * E / num_expert_group.
        renormalize: divide each token's k weights by their sum (plus 1e-20).
        num_expert_group: G, the number of equal expert groups (expert e is in group e // (E/G));
            G divides E, and each group holds at least 2 experts when G > 1. G = 1: plain top-k.
        topk_group: the number of groups each token may use, 1 <= topk_group <= G.
        scoring_func: "sigmoid" (DeepSeek-V3/R1) or "softmax" (over each row).
        e_score_correction_bias: `[E]` `torch.float32` on gating_output's device, finite, or
            None (zero). Added to the scores to choose groups and experts, never to the weights.
            Checked finite as the layer checks ids: always on the CPU, on CUDA with
            VLLM_MOE_CHECK_IDS=1 (the check reads the values, a host synchronisation).
        routed_scaling_factor: finite number > 0 multiplying the weights (after renormalising).
            The weights carry the factor, so the MoE layer needs no extra scale. vLLM's DeepSeek
            model instead multiplies the MoE layer's output by it; pass 1.0 for vLLM's weights.

    Returns:
        topk_weights: `[M, k]` `torch.float32`, the unbiased scores of the chosen experts,
            renormalised and scaled as above.
        topk_ids: `[M, k]` `torch.int64`, the chosen experts, largest biased score first, equal
            scores lowest expert id first (groups likewise: equal group scores, lowest group
            first). A NaN score ranks lowest.

    Group score: the sum of the group's 2 largest biased scores, with or without a bias, as
    DeepSeek-V3's model code does for its bias-carrying (noaux_tc) router; vLLM's torch
    grouped_topk uses the group's largest score when no bias is given. Scores are sigmoid/softmax
    in float64 rounded to float32 (within an ulp of torch.sigmoid in float32). CUDA tensors run one
    Triton kernel, CPU tensors the torch path; both choose the same experts, bit for bit.
    """
    _check_args(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                e_score_correction_bias, routed_scaling_factor)
    check_values = envs.values_checked_on(gating_output.device)
    if check_values and e_score_correction_bias is not None:
        _check_bias_finite(e_score_correction_bias)
    kwargs = dict(renormalize=renormalize, num_expert_group=num_expert_group,
                  topk_group=topk_group, scoring_func=scoring_func,
                  e_score_correction_bias=e_score_correction_bias,
                  routed_scaling_factor=routed_scaling_factor)
    if not gating_output.is_cuda:
        return grouped_topk_ref(gating_output, topk, **kwargs)
    M = gating_output.shape[0]
    topk_weights = torch.empty(M, topk, dtype=torch.float32, device=gating_output.device)
    topk_ids = torch.empty(M, topk, dtype=torch.int64, device=gating_output.device)
    grouped_topk_triton(gating_output, topk_weights, topk_ids, **kwargs)
    return topk_weights, topk_ids
