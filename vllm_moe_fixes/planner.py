"""Will a DP/EP configuration come up? Expert load, memory and DeepEP buffers of the dummy run.

An engine's profile (dummy) run pushes ``max_tokens`` tokens through every data-parallel rank. With
all-zero token ids every token routes to the same top-k experts, so the expert-parallel ranks owning
them receive every token of the EP group; with random ids (``VLLM_RANDOMIZE_DP_DUMMY_INPUTS``) the
load spreads out. ``make_plan`` simulates both with a random-initialised router of the model's
shapes and sizes, at the busiest rank, what the failure modes of the README's first table depend on.

Routing simulation (``SimulatedRouter``): a gate [E, H] drawn as ``nn.Linear`` initialises it
(uniform in +-1/sqrt(H)) and an embedding [vocab, H] drawn as ``nn.Embedding`` does (unit normal).
The embedding is never materialised: an embedding row e reaches the router only as ``gate @ e``,
which is normal with covariance C = ``gate gate^T`` [E, E]. When E < H, C = L L^T (Cholesky; C is
positive definite) and the logits ``z @ L^T`` of a standard normal E-vector z have exactly that
distribution, so one E-vector per *used* id stands for an embedding row at the model's real hidden
size (E numbers per id instead of H, and no [vocab, H] table); when E >= H the H-vector z is the
embedding row itself and the logits are ``z @ gate^T``. The rows are drawn per ``route`` call for
the distinct ids of that call: equal ids share their logits (all-zero ids: one row for every
token), which is all the load statistics need, without a stored table.

Sampling: an EP group of ``ep`` ranks holds ``ep * max_tokens`` tokens. At most ``SAMPLE_TOKENS``
of them are simulated (random ids are independent, so a sample is representative) and the loads
scaled to the whole group; sampling noise can only add imbalance, so the busiest/mean ratio from a
sample is a slight over-estimate. All-zero ids are exact at any sample size.

Passes: the modular kernel runs a rank's ``max_tokens`` in passes of at most
``VLLM_FUSED_MOE_CHUNK_SIZE`` tokens (one dispatch each), so the loads are those of one pass of
``ep * min(max_tokens, VLLM_FUSED_MOE_CHUNK_SIZE)`` tokens. The contiguous experts take what a rank
received in passes of at most ``VLLM_FUSED_MOE_CHUNK_SIZE`` tokens too (``experts_pass_tokens``)
so their workspaces do not grow with the received count; the plan shows the memory with that
bound and, beside it (``one_pass``), what experts that take all received tokens in one pass need.
The batched layout needs no such bound: its workspaces are sized by the capacity T = ep *
max_tokens rows per local expert, whatever the routing.

Memory model at the busiest rank (the one receiving the most tokens; bytes): the MoE weights of
its local experts over all MoE layers (FP8 with float32 128x128 block scales) + the device
footprint of the backend's DeepEP buffer (v1.2.1, ``deepep_buffer_footprint_bytes``: its byte
counts, DeepEP's 32 MiB workspace, NVSHMEM's heap granularity and fixed cost; V2,
``elastic_buffer_footprint_bytes``: V2's hint and its workspace, NCCL's own state not counted;
both are reported whichever backend runs) + one layer's received rows,
expert workspaces (``vllm_moe_fixes.sizes``, the shapes the experts ask the modular kernel for;
they hold the experts' output) and result (the modular kernel reuses the workspaces across
layers).
Dense layers, attention, KV cache and shared experts are not counted: it is a lower bound.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from vllm_moe_fixes import envs
from vllm_moe_fixes.config import MoEModelConfig
from vllm_moe_fixes._validate import check_nonnegative_int, check_positive_int
from vllm_moe_fixes.distributed.deepep_sizing import (
    LL_SUPPORTED_HIDDEN,
    check_deepep_config,
    deepep_buffer_footprint_bytes,
    deepep_ll_rdma_bytes,
    deepep_nvl_bytes,
    deepep_rdma_bytes,
)
from vllm_moe_fixes.distributed.deepep_v2_sizing import (
    check_elastic_config,
    elastic_buffer_footprint_bytes,
)
from vllm_moe_fixes.sizes import (
    SCALE_BLOCK,
    batched_workspace_shapes,
    cdiv,
    contiguous_workspace_shapes,
)

SAMPLE_TOKENS = 8192
# A fixed low-latency RDMA buffer of 1 GiB, not sized by DeepEP's hint: at DP=128 it trips DeepEP's
# `layout.total_bytes <= num_rdma_bytes` assertion.
FIXED_RDMA_BYTES = 2**30
INT32_ELEMENTS = 2**31
DEFAULT_GPU_MEMORY_GIB = 141.0
INPUTS = ("zero", "random")
BF16_BYTES, FP8_BYTES, F32_BYTES = 2, 1, 4


class SimulatedRouter:
    """A random-initialised router of ``cfg``'s shapes (see the module docstring).

    Arguments:
        cfg: the model's shapes and routing (softmax top-k, or grouped top-k on sigmoid scores).
        seed: int; the gate and every draw derive from it (same seed, same routing).
    """

    def __init__(self, cfg: MoEModelConfig, seed: int = 0):
        self.cfg = cfg
        self.seed = seed
        bound = 1.0 / math.sqrt(cfg.hidden_size)
        gate = np.random.default_rng([seed, 0]).uniform(
            -bound, bound, size=(cfg.num_experts, cfg.hidden_size)).astype(np.float32)
        if cfg.num_experts < cfg.hidden_size:
            cov = (gate @ gate.T).astype(np.float64)
            self._factor = np.linalg.cholesky(cov).T.astype(np.float32)  # [E, E]
        else:
            self._factor = gate.T  # [H, E]

    def _logits(self, num_ids: int) -> np.ndarray:
        """Router logits float32 [num_ids, E] of ``num_ids`` distinct token ids."""
        z = np.random.default_rng([self.seed, 2]).standard_normal(
            (num_ids, self._factor.shape[0]), dtype=np.float32)
        return z @ self._factor

    def route(self, token_ids: np.ndarray) -> np.ndarray:
        """Top-k expert ids int64 [T, k] for int token ids [T] (equal ids route alike)."""
        unique, inverse = np.unique(token_ids, return_inverse=True)
        return self.route_logits(self._logits(unique.size))[inverse.reshape(-1)]

    def route_logits(self, logits: np.ndarray) -> np.ndarray:
        """Top-k expert ids int64 [T, k] (in no particular order) for router logits float32 [T, E].

        softmax: the k largest logits (softmax is monotone). sigmoid with n_group > 1 (DeepSeek-V3):
        scores = sigmoid(logits) (+ a correction bias, zero here); a group's score is the sum of its
        2 best scores; only the topk_group best groups stay eligible; the k best eligible scores
        win.
        """
        cfg = self.cfg
        scores = logits
        if cfg.scoring == "sigmoid":
            scores = 1.0 / (1.0 + np.exp(-scores))
        if cfg.n_group > 1:
            grouped = scores.reshape(len(scores), cfg.n_group, -1)
            group_score = np.partition(grouped, -2, axis=-1)[..., -2:].sum(-1)  # [T, G]
            best = np.argpartition(-group_score, cfg.topk_group - 1, axis=1)[:, :cfg.topk_group]
            eligible = np.zeros(group_score.shape, dtype=bool)
            np.put_along_axis(eligible, best, True, axis=1)
            scores = np.where(eligible[..., None], grouped, -np.inf).reshape(len(scores), -1)
        topk = np.argpartition(-scores, cfg.top_k - 1, axis=1)[:, :cfg.top_k]
        return topk.astype(np.int64)


@dataclass
class RankLoads:
    """Per-EP-rank load of one EP group, scaled to all its tokens.

    slots: int64 [ep], routed (token, expert) pairs landing on each rank's experts.
    tokens: int64 [ep], distinct tokens each rank receives (a token arrives once per rank).
    """

    slots: np.ndarray
    tokens: np.ndarray


def _routed_sample(router: SimulatedRouter, *, num_tokens: int, inputs: str,
                   sample_tokens: int) -> tuple[np.ndarray, float]:
    """(top-k expert ids int64 [sample, k] of at most ``sample_tokens`` dummy tokens, the factor
    that scales the sample's counts to ``num_tokens``)."""
    if inputs not in INPUTS:
        raise ValueError(f"inputs={inputs!r}; allowed: {', '.join(INPUTS)}")
    sample = min(num_tokens, sample_tokens)
    if inputs == "zero":
        ids = np.zeros(sample, dtype=np.int64)
    else:
        ids = np.random.default_rng([router.seed, 1]).integers(0, router.cfg.vocab_size, sample)
    return router.route(ids), num_tokens / sample


def simulate_loads(router: SimulatedRouter, *, ep: int, num_tokens: int, inputs: str,
                   sample_tokens: int = SAMPLE_TOKENS) -> RankLoads:
    """Route ``num_tokens`` dummy tokens ("zero" or "random" ids) and count each EP rank's load.

    Experts are split contiguously: rank r owns experts [r*E/ep, (r+1)*E/ep). At most
    ``sample_tokens`` tokens are routed, the counts scaled to ``num_tokens``. Raises ValueError
    when ``ep`` does not divide the expert count or ``inputs`` is unknown.
    """
    cfg = router.cfg
    if cfg.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide {cfg.name}'s {cfg.num_experts} experts")
    ids, scale = _routed_sample(router, num_tokens=num_tokens, inputs=inputs,
                                sample_tokens=sample_tokens)
    rank = ids // (cfg.num_experts // ep)  # [T, k]
    slots = np.bincount(rank.ravel(), minlength=ep)
    hit = np.zeros((len(ids), ep), dtype=bool)
    np.put_along_axis(hit, rank, True, axis=1)
    return RankLoads(np.rint(slots * scale).astype(np.int64),
                     np.rint(hit.sum(0) * scale).astype(np.int64))


def simulate_eplb_loads(router: SimulatedRouter, *, ep: int, num_physical: int, num_tokens: int,
                        inputs: str, sample_tokens: int = SAMPLE_TOKENS) -> RankLoads:
    """Each EP rank's load once our rebalancer (``eplb.rebalance``) has placed ``num_physical``
    physical experts from the same routed sample (a logical expert's slots split evenly over its
    replicas). ``tokens`` is an upper bound: the slots a rank receives, at most every token."""
    from vllm_moe_fixes.eplb.rebalance import rank_loads, rebalance

    ids, scale = _routed_sample(router, num_tokens=num_tokens, inputs=inputs,
                                sample_tokens=sample_tokens)
    load = np.bincount(ids.ravel(), minlength=router.cfg.num_experts) * scale
    slots = rank_loads(load, rebalance(load, num_physical=num_physical, world_size=ep), ep)
    return RankLoads(np.rint(slots).astype(np.int64),
                     np.rint(np.minimum(slots, num_tokens)).astype(np.int64))


def _layer(cfg: MoEModelConfig, *, layout: str, tokens: int, local_num_experts: int,
           group_tokens: int, max_tokens: int,
           experts_pass_tokens: int | None) -> tuple[dict[str, int], dict]:
    """(bytes of one layer's allocations, the largest kernel tensor) at a rank receiving ``tokens``.

    Allocations: the received rows (FP8 with float32 1x128 scales), the two bf16 workspaces of
    ``vllm_moe_fixes.sizes`` (the experts' output lives inside ws13) and the bf16 [max_tokens, K]
    result. Standard layout: ``tokens`` received rows of k slots, M_sum GEMM rows of one pass of
    at most ``experts_pass_tokens`` tokens (None: all in one pass); batched layout: T =
    ``group_tokens`` rows per local expert slice whatever the routing.

    The largest tensor a kernel indexes is the GEMM1 output [rows, 2I], the GEMM2 output
    [rows, K] (rows = M_sum or E_l * T) or the received activations and the experts' output
    [tokens, K].
    """
    K, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k
    if layout == "batched":
        ws13, ws2, _ = batched_workspace_shapes(group_tokens, I, K, local_num_experts)
        recv = rows = ws13[0] * ws13[1]  # E_l * T
    else:
        ws13, ws2, _ = contiguous_workspace_shapes(tokens, I, K, k, local_num_experts,
                                                   experts_pass_tokens)
        recv, rows = tokens, ws13[0]  # M_sum
    layer = {"recv_x": recv * K * FP8_BYTES + recv * cdiv(K, SCALE_BLOCK) * F32_BYTES,
             "workspace13": math.prod(ws13) * BF16_BYTES,
             "workspace2": math.prod(ws2) * BF16_BYTES,
             "layer_output": max_tokens * K * BF16_BYTES}
    tensors = [(rows * 2 * I, f"GEMM1 output [{rows}, {2 * I}]"),
               (rows * K, f"GEMM2 output [{rows}, {K}]"),
               (recv * K, f"received activations / experts' output [{recv}, {K}]")]
    elements, name = max(tensors)
    return layer, {"name": name, "elements": elements}


def _weight_bytes(cfg: MoEModelConfig, local_num_experts: int) -> int:
    K, I = cfg.hidden_size, cfg.moe_intermediate_size
    scale_blocks = ((cdiv(2 * I, SCALE_BLOCK) + cdiv(I, SCALE_BLOCK))
                    * cdiv(K, SCALE_BLOCK))
    per_expert = 3 * I * K * FP8_BYTES + scale_blocks * F32_BYTES
    return cfg.num_moe_layers * local_num_experts * per_expert


def _hint_or_none(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError:
        return None  # DeepEP has no tuned config for this rank count, or refuses the sizes


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _check_arguments(dp, ep, max_tokens, backend, gpu_memory_gib, seed) -> tuple[int, int, str]:
    """Validate make_plan's arguments; return (ep, max_tokens, backend) with defaults filled in."""
    for name, value in (("dp", dp), ("ep", ep), ("max_tokens", max_tokens)):
        if value is not None:
            check_positive_int(name, value)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0")
    ep = dp if ep is None else ep
    max_tokens = envs.VLLM_MOE_DP_CHUNK_SIZE if max_tokens is None else max_tokens
    backend = envs.VLLM_ALL2ALL_BACKEND if backend is None else backend
    if backend not in envs.ALL2ALL_BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {', '.join(envs.ALL2ALL_BACKENDS)}")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp} (an EP group is made of ep of the DP ranks)")
    finite = isinstance(gpu_memory_gib, (int, float)) and math.isfinite(gpu_memory_gib)
    if not (finite and gpu_memory_gib > 0):
        raise ValueError(f"gpu_memory_gib must be a finite number > 0, got {gpu_memory_gib!r}")
    return ep, max_tokens, backend


def _size_buffers(cfg: MoEModelConfig, backend: str, ep: int, max_tokens: int,
                  num_experts: int | None = None) -> tuple[dict, dict]:
    """DeepEP's byte counts for this group and the buffer the backend builds, with the same checks
    as ``make_all2all_buffer`` (``check_deepep_config``), for ``num_experts`` physical experts
    (default the model's; with EPLB, its logical plus redundant ones).

    Returns (deepep, cannot_serve): deepep holds the hints, the buffer's byte counts and its device
    footprint (``buffer_bytes``: 0 for one rank or the naive backend, which keep no standing
    buffer); cannot_serve is the flag {raised, detail} for a configuration DeepEP refuses.
    """
    K, E = cfg.hidden_size, cfg.num_experts if num_experts is None else num_experts
    nvl = envs.VLLM_DEEPEP_BUFFER_SIZE_MB * 2**20
    deepep = {"nvl_bytes": nvl,
              "nvl_hint_bytes": _hint_or_none(deepep_nvl_bytes, K, ep),
              "ht_rdma_hint_bytes": _hint_or_none(deepep_rdma_bytes, K, ep),
              "ll_rdma_hint_bytes": deepep_ll_rdma_bytes(max_tokens, K, ep, E),
              "fixed_rdma_bytes": FIXED_RDMA_BYTES,
              "buffer_kwargs": None, "buffer_bytes": 0}
    # DeepEP V2 as make_all2all_buffer builds it (top-k 32; 8-GPU NVLink domains assumed here).
    v2_hint = _hint_or_none(check_elastic_config, num_ranks=ep, max_tokens_per_rank=max_tokens,
                            hidden=K, num_experts=E)
    deepep["v2_hint_bytes"] = v2_hint
    deepep["v2_buffer_bytes"] = None if v2_hint is None else elastic_buffer_footprint_bytes(v2_hint)
    if ep == 1 or backend == "naive":
        why = ("one rank: no all-to-all" if ep == 1
               else "naive backend: torch.distributed all-to-all")
        return deepep, {"raised": False, "detail": f"{backend}: not a DeepEP configuration ({why})"}
    try:
        if backend == "deepep_v2":
            kwargs = {"num_bytes": check_elastic_config(
                num_ranks=ep, max_tokens_per_rank=max_tokens, hidden=K, num_experts=E)}
        else:
            kwargs = check_deepep_config(backend, num_ranks=ep, max_tokens_per_rank=max_tokens,
                                         hidden=K, num_experts=E, nvl_bytes=nvl)
    except ValueError as e:
        return deepep, {"raised": True, "detail": f"{backend} cannot run this configuration: {e}"}
    deepep["buffer_kwargs"] = kwargs
    deepep["buffer_bytes"] = (elastic_buffer_footprint_bytes(**kwargs) if backend == "deepep_v2"
                              else deepep_buffer_footprint_bytes(**kwargs))
    return deepep, {"raised": False, "detail": f"{backend} accepts ep={ep}, hidden={K}, "
                                               f"max_tokens={max_tokens}, experts={E}"}


def _compute_loads(cfg: MoEModelConfig, sims: dict, *, layout: str, local_num_experts: int,
                   group_tokens: int, max_tokens: int, fixed_bytes: int,
                   experts_pass_tokens: int | None) -> dict:
    """Per input kind: the busiest rank's load, one layer's allocations at the rank receiving the
    most tokens (memory grows with the tokens received) and its memory (``fixed_bytes`` of weights
    and buffers + the layer), with the experts' bound ``experts_pass_tokens`` and, under
    ``one_pass``, without it."""
    loads = {}
    for inputs, sim in sims.items():
        kwargs = dict(layout=layout, tokens=int(sim.tokens.max()),
                      local_num_experts=local_num_experts, group_tokens=group_tokens,
                      max_tokens=max_tokens)
        layer, largest = _layer(cfg, **kwargs, experts_pass_tokens=experts_pass_tokens)
        one_pass, one_pass_largest = _layer(cfg, **kwargs, experts_pass_tokens=None)
        busiest = int(np.argmax(sim.slots))
        mean = float(sim.slots.mean())
        loads[inputs] = {
            "busiest_rank": busiest, "busiest_slots": int(sim.slots[busiest]),
            "mean_slots": mean, "imbalance": float(sim.slots[busiest] / mean) if mean else 0.0,
            "busiest_tokens": int(sim.tokens.max()), "slots_per_rank": sim.slots.tolist(),
            "layer_bytes": layer,
            "memory_bytes": fixed_bytes + sum(layer.values()),
            "largest_tensor": largest,
            "one_pass": {"layer_bytes": one_pass,
                         "memory_bytes": fixed_bytes + sum(one_pass.values()),
                         "largest_tensor": one_pass_largest},
        }
    return loads


def _raise_flags(cfg: MoEModelConfig, loads: dict, deepep: dict, cannot_serve: dict, *, ep: int,
                 max_tokens: int, gpu_memory_gib: float, backend: str) -> dict:
    """name -> {raised, detail} for each failure mode the plan checks (of this configuration:
    what cannot happen in it is not raised, and the detail says why)."""
    K, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    budget = gpu_memory_gib * 2**30
    flags = {}
    for inputs in INPUTS:
        mem, one_pass = loads[inputs]["memory_bytes"], loads[inputs]["one_pass"]["memory_bytes"]
        flags[f"dummy_run_oom_{inputs}_inputs"] = {
            "raised": mem > budget,
            "detail": f"{inputs} ids: {_gib(mem)} per GPU at the busiest rank (weights, all-to-all "
                      f"buffer footprint and one layer's activations; a lower bound) vs "
                      f"{gpu_memory_gib:g} GiB; experts taking all received tokens in one pass: "
                      f"{_gib(one_pass)}"}
    flags["block_quant_shapes"] = {
        "raised": bool(K % SCALE_BLOCK or I % SCALE_BLOCK),
        "detail": f"hidden {K}, intermediate {I}: FP8 {SCALE_BLOCK}x{SCALE_BLOCK} block "
                  f"quantisation needs both to be multiples of {SCALE_BLOCK}"}
    ll_hint = deepep["ll_rdma_hint_bytes"]
    versus = (f"a fixed {_gib(FIXED_RDMA_BYTES)} low-latency RDMA buffer vs the hint {ll_hint} "
              f"bytes ({_gib(ll_hint)}) for N={max_tokens}, H={K}, E={E}")
    if backend == "deepep_low_latency" and ep > 1:
        flags["fixed_rdma_below_ll_hint"] = {
            "raised": FIXED_RDMA_BYTES < ll_hint,
            "detail": f"{versus}: DeepEP's 'layout.total_bytes <= num_rdma_bytes' assertion"}
    else:
        why = "one rank has no all-to-all" if ep == 1 else f"the {backend} backend builds none"
        flags["fixed_rdma_below_ll_hint"] = {
            "raised": False,
            "detail": f"no low-latency RDMA buffer here ({why}); deepep_low_latency at ep > 1 "
                      f"would compare {versus}"}
    flags["ll_unsupported_hidden"] = {
        "raised": K not in LL_SUPPORTED_HIDDEN,
        "detail": f"hidden {K}; DeepEP low-latency supports "
                  f"{', '.join(map(str, LL_SUPPORTED_HIDDEN))}"}
    nvl, nvl_hint = deepep["nvl_bytes"], deepep["nvl_hint_bytes"]
    flags["nvl_buffer_below_hint"] = {
        "raised": nvl_hint is not None and nvl < nvl_hint,
        "detail": f"VLLM_DEEPEP_BUFFER_SIZE_MB gives {nvl} bytes vs DeepEP's high-throughput hint "
                  + (str(nvl_hint) if nvl_hint is not None
                     else f"n/a (no tuned config for {ep} ranks)")}
    flags["deepep_cannot_serve"] = cannot_serve
    return flags


def _notes(loads: dict) -> dict:
    """name -> text: facts of this configuration that are not failures here."""
    notes = {}
    for inputs in INPUTS:
        big = loads[inputs]["largest_tensor"]
        past = big["elements"] >= INT32_ELEMENTS
        notes[f"int32_elements_{inputs}_inputs"] = (
            f"{inputs} ids: largest kernel tensor {big['name']} has {big['elements']} elements, "
            + ("past 2**31: a kernel with 32-bit offsets would break on it (every kernel here "
               "computes 64-bit offsets)" if past else "below 2**31"))
    return notes


def _check_redundant(cfg: MoEModelConfig, redundant_experts, ep: int) -> int:
    """The physical expert count E + R; ValueError unless R is an int >= 0 and E + R divides
    over the ep ranks (every rank holds the same number of physical experts)."""
    check_nonnegative_int("redundant_experts", redundant_experts)
    physical = cfg.num_experts + redundant_experts
    if physical % ep:
        raise ValueError(f"redundant_experts={redundant_experts}: {cfg.num_experts} + "
                         f"{redundant_experts} = {physical} physical experts do not divide over "
                         f"ep={ep} ranks (every rank holds the same number)")
    return physical


def _plan_eplb(cfg: MoEModelConfig, router: SimulatedRouter, without: dict, *, physical: int,
               ep: int, max_tokens: int, num_tokens: int, backend: str, layout: str,
               experts_pass_tokens: int | None, gpu_memory_gib: float) -> dict:
    """The plan's ``eplb`` part: the same dummy run with ``physical`` experts placed by our
    rebalancer. Local experts, weights, DeepEP buffers (the low-latency and V2 ones grow with
    the expert count) and the busiest rank's memory; a flag per input kind where it does not
    fit in ``gpu_memory_gib``, with the numbers beside those of ``without`` (the loads without
    EPLB). num_tokens: the group's tokens of one dispatch chunk."""
    sims = {inputs: simulate_eplb_loads(router, ep=ep, num_physical=physical,
                                        num_tokens=num_tokens, inputs=inputs)
            for inputs in INPUTS}
    deepep, cannot_serve = _size_buffers(cfg, backend, ep, max_tokens, num_experts=physical)
    local = physical // ep
    weight_bytes = _weight_bytes(cfg, local)
    loads = _compute_loads(cfg, sims, layout=layout, local_num_experts=local,
                           group_tokens=ep * max_tokens, max_tokens=max_tokens,
                           fixed_bytes=weight_bytes + deepep["buffer_bytes"],
                           experts_pass_tokens=experts_pass_tokens)
    flags = {}
    for inputs in INPUTS:
        mem = loads[inputs]["memory_bytes"]
        flags[f"eplb_does_not_fit_{inputs}_inputs"] = {
            "raised": mem > gpu_memory_gib * 2**30,
            "detail": f"{inputs} ids, {physical - cfg.num_experts} redundant experts ({local} "
                      f"physical per rank): {_gib(mem)} per GPU at the busiest rank (weights "
                      f"{_gib(weight_bytes)}, all-to-all buffer {_gib(deepep['buffer_bytes'])}, "
                      f"one layer {_gib(mem - weight_bytes - deepep['buffer_bytes'])}) vs "
                      f"{gpu_memory_gib:g} GiB; without EPLB "
                      f"{_gib(without[inputs]['memory_bytes'])}"}
    flags["eplb_deepep_cannot_serve"] = cannot_serve
    return {"redundant_experts": physical - cfg.num_experts, "physical_experts": physical,
            "local_experts": local, "weight_bytes": weight_bytes,
            "buffer_bytes": deepep["buffer_bytes"], "deepep": deepep, "loads": loads,
            "flags": flags}


def make_plan(cfg: MoEModelConfig, *, dp: int, ep: int | None = None, max_tokens: int | None = None,
              backend: str | None = None, gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB,
              seed: int = 0, redundant_experts: int | None = None) -> dict:
    """Plan one EP group's dummy run for zero and random ids; return a JSON-ready dict.

    Arguments:
        cfg: model shapes.
        dp: data-parallel ranks (>= 1); ep: ranks of one EP group (default dp; must divide dp and
            the expert count); each rank runs max_tokens dummy tokens (default
            VLLM_MOE_DP_CHUNK_SIZE).
        backend: all-to-all backend (default VLLM_ALL2ALL_BACKEND); deepep_low_latency uses the
            batched layout, the others (and ep == 1) the standard one.
        gpu_memory_gib: memory budget per GPU for the OOM flag (finite, > 0).
        seed: routing simulation seed (int >= 0).

    Returns a dict with keys: model, dp, ep, max_tokens, backend, layout, gpu_memory_gib,
    local_experts, dispatch_chunk_tokens (tokens per rank per dispatch chunk of the layer:
    min(max_tokens, VLLM_FUSED_MOE_CHUNK_SIZE)), experts_pass_tokens (the contiguous experts'
    inner-pass bound, None for the batched layout), group_tokens (of one dispatch chunk:
    ep * dispatch_chunk_tokens), simulated_tokens, seed,
    inputs_in_effect, loads (per input kind: busiest_rank, busiest_slots, mean_slots, imbalance,
    busiest_tokens, slots_per_rank, layer_bytes, memory_bytes, largest_tensor, and one_pass:
    layer_bytes, memory_bytes, largest_tensor of experts without the bound), weight_bytes,
    buffer_bytes (the DeepEP buffer's device footprint), deepep (v1.2.1's hints, V2's
    v2_hint_bytes and v2_buffer_bytes (None where V2 refuses the sizes), buffer_kwargs,
    buffer_bytes), flags (name -> {raised, detail}), notes (name -> text), elapsed_s, and eplb:
    None, or with ``redundant_experts`` R (int >= 0; E + R must divide over ep) the same dummy
    run with E + R physical experts placed by ``eplb.rebalance``: redundant_experts,
    physical_experts, local_experts, weight_bytes, buffer_bytes, deepep, loads (as above; the
    tokens received are bounded by the slots) and flags (eplb_does_not_fit_<inputs>_inputs,
    eplb_deepep_cannot_serve).
    """
    start = time.perf_counter()
    ep, max_tokens, backend = _check_arguments(dp, ep, max_tokens, backend, gpu_memory_gib, seed)
    chunk = envs.VLLM_FUSED_MOE_CHUNK_SIZE
    dispatch_chunk_tokens = min(max_tokens, chunk)
    physical = None if redundant_experts is None else _check_redundant(cfg, redundant_experts, ep)
    router = SimulatedRouter(cfg, seed)
    # simulate_loads raises first when ep does not divide the expert count.
    sims = {inputs: simulate_loads(router, ep=ep, num_tokens=ep * dispatch_chunk_tokens,
                                   inputs=inputs)
            for inputs in INPUTS}
    deepep, cannot_serve = _size_buffers(cfg, backend, ep, max_tokens)
    local_num_experts = cfg.num_experts // ep
    layout = "batched" if backend == "deepep_low_latency" and ep > 1 else "standard"
    experts_pass_tokens = chunk if layout == "standard" else None
    weight_bytes = _weight_bytes(cfg, local_num_experts)
    loads = _compute_loads(cfg, sims, layout=layout, local_num_experts=local_num_experts,
                           group_tokens=ep * max_tokens, max_tokens=max_tokens,
                           fixed_bytes=weight_bytes + deepep["buffer_bytes"],
                           experts_pass_tokens=experts_pass_tokens)
    flags = _raise_flags(cfg, loads, deepep, cannot_serve, ep=ep, max_tokens=max_tokens,
                         gpu_memory_gib=gpu_memory_gib, backend=backend)
    eplb = None if physical is None else _plan_eplb(
        cfg, router, loads, physical=physical, ep=ep, max_tokens=max_tokens,
        num_tokens=ep * dispatch_chunk_tokens, backend=backend, layout=layout,
        experts_pass_tokens=experts_pass_tokens, gpu_memory_gib=gpu_memory_gib)
    return {
        "model": cfg.to_dict(), "dp": dp, "ep": ep, "max_tokens": max_tokens, "backend": backend,
        "layout": layout, "gpu_memory_gib": gpu_memory_gib, "local_experts": local_num_experts,
        "dispatch_chunk_tokens": dispatch_chunk_tokens, "experts_pass_tokens": experts_pass_tokens,
        "group_tokens": ep * dispatch_chunk_tokens,
        "simulated_tokens": min(ep * dispatch_chunk_tokens, SAMPLE_TOKENS), "seed": seed,
        "inputs_in_effect": "random" if envs.VLLM_RANDOMIZE_DP_DUMMY_INPUTS and dp > 1 else "zero",
        "loads": loads, "weight_bytes": weight_bytes, "buffer_bytes": deepep["buffer_bytes"],
        "deepep": deepep, "flags": flags, "notes": _notes(loads), "eplb": eplb,
        "elapsed_s": time.perf_counter() - start,
    }


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of (label, value, value...) as lines: the label column left-aligned, the others
    right-aligned, every column as wide as its widest cell (so huge values stay aligned)."""
    cells = [row for row in rows if len(row) > 1]
    widths = [max(len(row[i]) for row in cells) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        if len(row) == 1:  # a section heading
            lines.append(row[0])
            continue
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return lines


def _format_eplb(plan: dict) -> list[str]:
    """The EPLB comparison: the busiest rank without and with E + R physical experts."""
    e = plan["eplb"]
    rows = [("per rank, zero / random ids", "no EPLB", f"EPLB, R={e['redundant_experts']}")]
    for inputs in INPUTS:
        off, on = plan["loads"][inputs], e["loads"][inputs]
        rows += [(f"{inputs} ids",),
                 ("  busiest / mean token-slots", f"{off['imbalance']:.2f}x",
                  f"{on['imbalance']:.2f}x"),
                 ("  memory (lower bound)", _gib(off["memory_bytes"]), _gib(on["memory_bytes"]))]
    d_off, d_on = plan["deepep"], e["deepep"]
    rows += [("physical experts per rank", str(plan["local_experts"]), str(e["local_experts"])),
             ("expert weights (all layers)", _gib(plan["weight_bytes"]), _gib(e["weight_bytes"])),
             ("all-to-all buffer footprint", _gib(plan["buffer_bytes"]), _gib(e["buffer_bytes"])),
             ("DeepEP LL RDMA hint", _gib(d_off["ll_rdma_hint_bytes"]),
              _gib(d_on["ll_rdma_hint_bytes"])),
             ("DeepEP V2 hint", _gib(d_off["v2_hint_bytes"]), _gib(d_on["v2_hint_bytes"]))]
    lines = [f"EPLB: {e['physical_experts']} physical experts placed by eplb.rebalance",
             *_table(rows)]
    for name, flag in e["flags"].items():
        lines.append(f"[{'FLAG' if flag['raised'] else ' ok '}] {name}: {flag['detail']}")
    return lines


def eplb_refusal(plan: dict) -> str | None:
    """Why the plan's EPLB placement does not fit (the raised flags' details), or None."""
    if plan["eplb"] is None:
        return None
    raised = [flag["detail"] for name, flag in plan["eplb"]["flags"].items()
              if flag["raised"] and name.startswith("eplb_does_not_fit")]
    return "; ".join(raised) or None


def format_plan(plan: dict) -> str:
    """The plan as a plain-text table (what ``vllm-moe-fixes plan`` prints)."""
    m = plan["model"]
    z, r = plan["loads"]["zero"], plan["loads"]["random"]
    sampled = (" (a sample: the random busiest/mean is an over-estimate)"
               if plan["simulated_tokens"] < plan["group_tokens"] else "")
    passes = cdiv(plan["max_tokens"], plan["dispatch_chunk_tokens"])
    lines = [
        f"model {m['name']}: K={m['hidden_size']} I={m['moe_intermediate_size']} "
        f"E={m['num_experts']} top-{m['top_k']} {m['scoring']}"
        + (f" (groups {m['n_group']}, top-{m['topk_group']})" if m["n_group"] > 1 else "")
        + f", {m['num_layers'] - m['num_dense_layers']} MoE layers",
        (f"dp={plan['dp']} ep={plan['ep']} max tokens/rank={plan['max_tokens']} "
         f"backend={plan['backend']} ({plan['layout']} layout) "
         f"experts/rank={plan['local_experts']} "
         f"budget={plan['gpu_memory_gib']:g} GiB"),
        (f"{passes} dispatch chunk(s) of {plan['dispatch_chunk_tokens']} tokens per rank "
         f"(VLLM_FUSED_MOE_CHUNK_SIZE); simulated {plan['simulated_tokens']} of one chunk's "
         f"{plan['group_tokens']} tokens "
         f"(seed {plan['seed']}){sampled}; dummy ids in effect now: {plan['inputs_in_effect']}"),
        "",
    ]
    rows = [("per rank", "zero ids", "random ids")]

    def row(label, fz, fr):
        rows.append((label, str(fz), str(fr)))

    def memory(title, zl, rl):
        rows.append((title,))
        for key in zl["layer_bytes"]:
            row(f"  {key}", _gib(zl["layer_bytes"][key]), _gib(rl["layer_bytes"][key]))
        row("  memory (lower bound)", _gib(zl["memory_bytes"]), _gib(rl["memory_bytes"]))
        row("  largest tensor (elements)", zl["largest_tensor"]["elements"],
            rl["largest_tensor"]["elements"])

    row("busiest rank token-slots", z["busiest_slots"], r["busiest_slots"])
    row("mean token-slots", f"{z['mean_slots']:.0f}", f"{r['mean_slots']:.0f}")
    row("busiest / mean", f"{z['imbalance']:.2f}x", f"{r['imbalance']:.2f}x")
    row("most tokens received", z["busiest_tokens"], r["busiest_tokens"])
    row("expert weights (all layers)", _gib(plan["weight_bytes"]), _gib(plan["weight_bytes"]))
    row("all-to-all buffer footprint", _gib(plan["buffer_bytes"]), _gib(plan["buffer_bytes"]))
    bound = plan["experts_pass_tokens"]
    if bound is None:
        memory("batched layout (bounded by its capacity, any routing):", z, r)
    else:
        memory(f"experts in passes of {bound} tokens (in effect):", z, r)
        memory("experts in one pass (no bound):", z["one_pass"], r["one_pass"])
    lines += _table(rows)
    d = plan["deepep"]
    lines += ["", (f"DeepEP: NVL buffer {_gib(d['nvl_bytes'])} (high-throughput hint "
                   f"{_gib(d['nvl_hint_bytes'])}), HT RDMA hint {_gib(d['ht_rdma_hint_bytes'])}, "
                   f"LL RDMA hint {d['ll_rdma_hint_bytes']} bytes "
                   f"({_gib(d['ll_rdma_hint_bytes'])})"),
              (f"DeepEP V2: ElasticBuffer hint {_gib(d['v2_hint_bytes'])} (device footprint "
               f"{_gib(d['v2_buffer_bytes'])} with its workspace, NCCL's own not counted)"),
              ""]
    for name, flag in plan["flags"].items():
        lines.append(f"[{'FLAG' if flag['raised'] else ' ok '}] {name}: {flag['detail']}")
    for name, text in plan["notes"].items():
        lines.append(f"[info] {name}: {text}")
    if plan["eplb"] is not None:
        lines += ["", *_format_eplb(plan)]
    lines.append(f"(planned in {plan['elapsed_s']:.2f} s)")
    return "\n".join(lines)
