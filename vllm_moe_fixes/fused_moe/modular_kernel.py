"""The modular MoE kernel: prepare -> experts -> finalize, with workspaces owned by the kernel.

A `PrepareAndFinalize` quantises (and, with expert parallelism, dispatches) the input and later
combines the experts' output; an `Experts` runs the two grouped GEMMs and, when it declares
`reduces_output`, also weights and sums each token's top-k rows. The kernel checks that both
speak the same `ActivationFormat`, asks the experts how much scratch they need
(`workspace_shapes`) and hands them views of two grow-only buffers that it keeps across calls:
a second call with the same or a smaller problem allocates no workspace.

    for each chunk of at most VLLM_FUSED_MOE_CHUNK_SIZE tokens (same workspaces every time):
        hidden_states[chunk] --prepare--> a1q, a1q_scale (+ received ids/weights with EP)
            --experts.apply--> [M', K] reduced (or [M', k, K] / [E_l, T, K] unreduced)
            --finalize--> output[chunk]

Memory of one call, counted on top of the inputs and weights:
    workspace13 + workspace2 (declared by the experts for one chunk, bf16 elements; kept)
    + the returned output [M, K]
    + what prepare allocates for one chunk (NoEP: a1q fp8 [M_c, K], a1q_scale f32 [M_c, K/128]).
(vllm_moe_fixes.sizes.layer_declared_bytes adds these up for one chunk.) The experts' output
(out_shape) is a view of the start of workspace13, so it costs nothing extra: an Experts
implementation must finish reading workspace13 before it writes `output`. When the experts reduce
and the prepare/finalize has nothing to combine (`passes_reduced_output_through`), the experts
write the layer's output directly.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from vllm_moe_fixes import envs
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, SCALE_BLOCK
from vllm_moe_fixes.ops.permute import check_routing_ranges
from vllm_moe_fixes.sizes import expected_rows_per_expert

_ID_DTYPES = (torch.int32, torch.int64)


class ActivationFormat(enum.Enum):
    """STANDARD: one row per token [M', K]. BATCHED: one slice per local expert [E_l, T, K]."""

    STANDARD = "standard"
    BATCHED = "batched"


@dataclass
class PrepareResult:
    """What prepare hands to the experts.

    a1q: float8_e4m3fn, STANDARD [M', K] / BATCHED [E_l, T, K].
    a1q_scale: float32 [M', K/128] / [E_l, T, K/128] (any strides).
    topk_ids: STANDARD: int32/int64 [M', k] GLOBAL expert ids, -1 = not on this rank; None =
        keep the caller's. The kernel passes these to the experts and to finalize.
    topk_weights: STANDARD: float32 [M', k] (0 where the id is -1); None = keep the caller's.
    expert_num_tokens: BATCHED: int32 [E_l] valid rows per expert slice; None for STANDARD.
    """

    a1q: torch.Tensor
    a1q_scale: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    expert_num_tokens: torch.Tensor | None = None


class PrepareAndFinalize(ABC):
    """Quantise/dispatch before the experts, weight/reduce/combine after them.

    passes_reduced_output_through: True when finalize has nothing to do with an output the
    experts already reduced (no combine): the kernel then lets such experts write the layer's
    output directly, and finalize receives that same tensor.
    """

    activation_format: ActivationFormat = ActivationFormat.STANDARD
    passes_reduced_output_through: bool = False

    @abstractmethod
    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, expert_map: torch.Tensor | None,
                apply_router_weight_on_input: bool) -> PrepareResult:
        """a1: bf16 [M, K] (M may be 0: a rank with fewer tokens runs empty chunks so that the
        collectives match); topk_weights: float32 [M, k]; topk_ids: int32 or int64 [M, k] global
        ids (-1: no expert); num_experts: global expert count E; expert_map: int32 [E] global ->
        local id or -1, or None; apply_router_weight_on_input: scale a1 by the (k == 1) weight
        before quantising."""

    @abstractmethod
    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 apply_router_weight_on_input: bool, *, output_is_reduced: bool = False) -> None:
        """Write output bf16 [M, K] (this chunk's tokens of the caller).

        fused_expert_output: STANDARD: [M', K] already weighted and summed over the k slots when
        output_is_reduced (the experts' `reduces_output`; it may be `output` itself when
        passes_reduced_output_through), else [M', k, K] one row per slot, unreduced (slots with
        id -1 exact zeros; may be modified in place). BATCHED: [E_l, T, K] (output_is_reduced is
        False). topk_weights / topk_ids are PrepareResult's when it gave them, else the caller's.
        apply_router_weight_on_input: the weights went on the input; an unreduced output is then
        summed without them.
        """

    def max_num_tokens_per_rank(self) -> int | None:
        """Upper bound on tokens per rank per call (sizes batched layouts), or None."""
        return None

    def num_dispatchers(self) -> int:
        """Ranks that send tokens to this one."""
        return 1

    def num_chunks(self, num_tokens: int, chunk_size: int,
                   max_tokens_across_ranks: int | None) -> int:
        """Passes of the experts for a call of num_tokens tokens, at most chunk_size per pass.

        Every rank of an expert-parallel group must return the same number (each pass is one
        dispatch and one combine); a rank with fewer tokens runs empty passes. Default:
        cdiv(max_tokens_across_ranks, chunk_size) when the caller gives the group's maximum;
        else cdiv(num_tokens, chunk_size) alone (one rank), and one pass with expert parallelism
        (no count is agreed without a collective: an expert-parallel subclass overrides this).
        """
        if max_tokens_across_ranks is not None:
            return -(-max_tokens_across_ranks // chunk_size)
        if self.num_dispatchers() == 1:
            return -(-num_tokens // chunk_size)
        return 1


class Experts(ABC):
    """Grouped FP8 expert GEMMs: GEMM1 (w1) -> SiLU(gate) * up -> GEMM2 (w2).

    reduces_output: True when apply also weights and sums each token's k slots (STANDARD only):
    out_shape is then [M', K] and finalize gets output_is_reduced=True.
    """

    activation_format: ActivationFormat = ActivationFormat.STANDARD
    reduces_output: bool = False

    @abstractmethod
    def workspace_shapes(self, M: int, N: int, K: int, topk: int,
                         local_num_experts: int) -> tuple[tuple[int, ...], tuple[int, ...],
                                                          tuple[int, ...]]:
        """Element shapes (ws13, ws2, out) of the bf16 workspaces and of the experts' output.

        M: rows of a1q (STANDARD) or T, rows per expert slice (BATCHED); N: intermediate size I
        (w1 [E_l, 2N, K], w2 [E_l, K, N]); K: hidden size; topk: k; local_num_experts: E_l.
        """

    @abstractmethod
    def apply(self, output: torch.Tensor, a1q: torch.Tensor, a1q_scale: torch.Tensor,
              w1: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor, w2_scale: torch.Tensor,
              topk_ids: torch.Tensor | None, expert_map: torch.Tensor | None, activation: str,
              workspace13: torch.Tensor, workspace2: torch.Tensor,
              expert_num_tokens: torch.Tensor | None, *, topk_weights: torch.Tensor | None = None,
              expected_m: int | None = None) -> None:
        """Write output (out_shape, bf16): a view of the start of workspace13's storage, or the
        layer's output when the experts reduce and finalize passes it through.

        a1q / a1q_scale: PrepareResult's; w1 fp8 [E_l, 2N, K], w1_scale f32 [E_l, 2N/128, K/128],
        w2 fp8 [E_l, K, N], w2_scale f32 [E_l, K/128, N/128]; topk_ids int32/int64 [M', k] global
        ids (STANDARD); expert_map int32 [E] or None; activation "silu"; workspace13 / workspace2
        bf16 views of the declared shapes (contents undefined on entry); expert_num_tokens int32
        [E_l] (BATCHED); topk_weights float32 [M', k] to weight the slots by when the experts
        reduce (None: plain sum, the weights went on the input); expected_m: average rows per
        local expert the dispatch can produce (BATCHED tiling hint), None = unknown.
        STANDARD: slots of non-local experts contribute exact zeros.
        """


class Workspaces:
    """Two grow-only bf16 buffers (per device), shareable by the kernels of several layers.

    `get` returns the same view objects for the same request (the latest _MAX_VIEWS requests are
    remembered) until a buffer grows, so the experts may cache their own views on them.
    """

    _MAX_VIEWS = 64

    def __init__(self) -> None:
        self.ws13: torch.Tensor | None = None
        self.ws2: torch.Tensor | None = None
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _get(self, name: str, numel: int, device: torch.device, dtype: torch.dtype):
        buf = getattr(self, name)
        if buf is None or buf.numel() < numel or buf.device != device or buf.dtype != dtype:
            self._views.clear()  # drop every view of the old buffer with it
            setattr(self, name, None)  # free the old buffer before allocating the larger one
            buf = torch.empty(numel, dtype=dtype, device=device)
            setattr(self, name, buf)
        return buf

    def get(self, ws13_shape, ws2_shape, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the requested shapes, growing a buffer when it is too small."""
        key = (ws13_shape, ws2_shape, device, dtype)
        views = self._views.get(key)
        if views is not None:
            return views
        n13, n2 = math.prod(ws13_shape), math.prod(ws2_shape)
        buf13 = self._get("ws13", n13, device, dtype)
        buf2 = self._get("ws2", n2, device, dtype)
        if len(self._views) >= self._MAX_VIEWS:
            del self._views[next(iter(self._views))]  # the oldest request
        views = self._views[key] = (buf13[:n13].view(ws13_shape), buf2[:n2].view(ws2_shape))
        return views


def views_cached_on(ws13: torch.Tensor, ws2: torch.Tensor, make, *sizes):
    """``make(ws13, ws2, *sizes)``, cached in a dict attached to ws2 itself: the kernel hands the
    same workspace view objects to every call of a shape until a buffer grows, so an experts'
    views built on them live exactly as long as those (never past a workspace that grew)."""
    cache = ws2.__dict__.setdefault("_views_of", {})
    key = (make, ws13.data_ptr(), ws2.data_ptr(), *sizes)
    views = cache.get(key)
    if views is None:
        views = cache[key] = make(ws13, ws2, *sizes)
    return views


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


class FusedMoEModularKernel:
    """One MoE layer: `prepare_finalize.prepare` -> `experts.apply` -> `prepare_finalize.finalize`.

    Args:
        prepare_finalize: a PrepareAndFinalize (NoEP, DeepEP high-throughput / low-latency).
        experts: an Experts of the same activation_format.
        workspaces: a Workspaces to share between layers; default: one owned by this kernel.
    """

    def __init__(self, prepare_finalize: PrepareAndFinalize, experts: Experts,
                 workspaces: Workspaces | None = None) -> None:
        if not isinstance(prepare_finalize, PrepareAndFinalize):
            raise ValueError(f"prepare_finalize must be a PrepareAndFinalize, got "
                             f"{type(prepare_finalize).__name__}")
        if not isinstance(experts, Experts):
            raise ValueError(f"experts must be an Experts, got {type(experts).__name__}")
        if prepare_finalize.activation_format != experts.activation_format:
            raise ValueError(
                f"{type(prepare_finalize).__name__} produces the "
                f"{prepare_finalize.activation_format.value} "
                f"activation format but {type(experts).__name__} takes "
                f"{experts.activation_format.value}; pair standard with standard "
                "(NoEP / DeepEP high-throughput + TritonExperts / DeepGemmExperts) and batched "
                "with batched (DeepEP low-latency + BatchedTritonExperts / "
                "BatchedDeepGemmExperts)")
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.workspaces = workspaces if workspaces is not None else Workspaces()

    def __call__(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, w1_scale: torch.Tensor,
                 w2_scale: torch.Tensor, global_num_experts: int,
                 expert_map: torch.Tensor | None = None, activation: str = "silu",
                 apply_router_weight_on_input: bool = False,
                 max_tokens_across_ranks: int | None = None) -> torch.Tensor:
        """Run the layer.

        Args:
            hidden_states: bfloat16 [M, K] with contiguous channels (stride(1) == 1), on every
                prepare/finalize alike.
            w1: float8_e4m3fn [E_l, 2I, K] (rows 0..I-1 gate, I..2I-1 up), contiguous.
            w2: float8_e4m3fn [E_l, K, I], contiguous.
            topk_weights: float32 [M, k].
            topk_ids: int32 or int64 [M, k], global expert ids in [-1, global_num_experts);
                -1 means "no expert": the slot contributes nothing (DeepEP's convention).
            w1_scale: float32 [E_l, 2I/128, K/128]; w2_scale: float32 [E_l, K/128, I/128].
            global_num_experts: E.
            expert_map: int32 [E], global -> local id in [-1, E_l); None: all experts local
                (E == E_l).
            activation: "silu" (the only one).
            apply_router_weight_on_input: multiply the input by the weight (needs k == 1) instead
                of the experts' output.
            max_tokens_across_ranks: with expert parallelism, the largest M of the group's ranks
                for this call, if the caller knows it (then the number of chunks is agreed
                without a collective); None otherwise.

        Returns:
            bfloat16 [M, K]: sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(hidden_states),
            where a non-local expert contributes exactly zero.

        Raises ValueError on malformed arguments, and on ids or expert_map entries out of range:
        always for CPU tensors; for CUDA tensors only with VLLM_MOE_CHECK_IDS=1, because the
        check reads the values (a host synchronisation per call, which also cannot be captured
        in a CUDA graph). Unchecked, an out-of-range id counts as non-local on the one-rank path.

        Tokens are processed in chunks of at most VLLM_FUSED_MOE_CHUNK_SIZE (and at most the
        prepare/finalize's max_num_tokens_per_rank), reusing the same workspaces; every token
        goes through the same arithmetic as in one pass (all steps work row by row).
        """
        self._validate(hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale,
                       global_num_experts, expert_map, activation, apply_router_weight_on_input,
                       max_tokens_across_ranks)
        M = hidden_states.shape[0]
        pf = self.prepare_finalize
        chunk = envs.VLLM_FUSED_MOE_CHUNK_SIZE
        capacity = pf.max_num_tokens_per_rank()
        if capacity is not None:
            chunk = min(chunk, capacity)
        num_chunks = pf.num_chunks(M, chunk, max_tokens_across_ranks)
        step = max(chunk, -(-M // num_chunks)) if num_chunks else chunk
        output = torch.empty_like(hidden_states)
        if num_chunks == 1:  # one pass takes the whole tensors (no slice views to build)
            self._run_chunk(hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale,
                            global_num_experts, expert_map, activation,
                            apply_router_weight_on_input, output)
            return output
        for i in range(num_chunks):
            rows = slice(min(i * step, M), min((i + 1) * step, M))
            self._run_chunk(hidden_states[rows], w1, w2, topk_weights[rows], topk_ids[rows],
                            w1_scale, w2_scale, global_num_experts, expert_map, activation,
                            apply_router_weight_on_input, output[rows])
        return output

    def _run_chunk(self, x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale,
                   global_num_experts, expert_map, activation, on_input, output) -> None:
        """prepare -> experts -> finalize for one chunk of tokens (validated arguments)."""
        pf, experts = self.prepare_finalize, self.experts
        E_l, N, K = w1.shape[0], w2.shape[2], x.shape[1]
        topk = topk_ids.shape[1]
        prep = pf.prepare(x, topk_weights, topk_ids, global_num_experts, expert_map, on_input)
        if prep.topk_ids is not None:
            topk_ids = prep.topk_ids
        if prep.topk_weights is not None:
            topk_weights = prep.topk_weights
        standard = experts.activation_format == ActivationFormat.STANDARD
        rows = prep.a1q.shape[0] if standard else prep.a1q.shape[1]
        ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(rows, N, K, topk, E_l)
        ws13, ws2 = self.workspaces.get(ws13_shape, ws2_shape, x.device, x.dtype)
        reduced = experts.reduces_output
        if reduced and pf.passes_reduced_output_through:
            fused_out = output
        else:
            if math.prod(out_shape) > ws13.numel():
                raise ValueError(f"{type(experts).__name__}.workspace_shapes: out_shape "
                                 f"{out_shape} does not fit in workspace13 {ws13_shape}")
            fused_out = ws13.view(-1)[:math.prod(out_shape)].view(out_shape)
        if rows > 0:  # rows == 0: out_shape has a zero dimension, fused_out is empty
            expected_m = None if standard else expected_rows_per_expert(
                pf.max_num_tokens_per_rank(), pf.num_dispatchers(), topk, global_num_experts,
                rows)
            experts.apply(fused_out, prep.a1q, prep.a1q_scale, w1, w2, w1_scale, w2_scale,
                          topk_ids, expert_map, activation, ws13, ws2, prep.expert_num_tokens,
                          topk_weights=None if on_input else topk_weights, expected_m=expected_m)
        pf.finalize(output, fused_out, topk_weights, topk_ids, on_input,
                    output_is_reduced=reduced)

    @staticmethod
    def _validate(x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, global_num_experts,
                  expert_map, activation, apply_router_weight_on_input,
                  max_tokens_across_ranks) -> None:
        # Each rule is tested first and its message formatted only when it fails: formatting the
        # shapes and dtypes of every message costs more host time than the tests themselves.
        for name, t in (("hidden_states", x), ("w1", w1), ("w2", w2),
                        ("topk_weights", topk_weights),
                        ("topk_ids", topk_ids), ("w1_scale", w1_scale), ("w2_scale", w2_scale)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t)}")
        if activation != "silu":
            raise ValueError(f"activation must be 'silu', got {activation!r}")
        if not (x.dim() == 2 and x.dtype == torch.bfloat16):
            raise ValueError(f"hidden_states must be bfloat16 [M, K], got {x.dtype} {_shape(x)}")
        M, K = x.shape
        if x.stride(1) != 1 and K > 1:
            raise ValueError(f"hidden_states must have contiguous channels (stride(1) == 1), "
                             f"got strides {x.stride()}")
        if not (w1.dim() == 3 and w1.dtype == FP8_DTYPE):
            raise ValueError(f"w1 must be float8_e4m3fn [E_l, 2I, K], got {w1.dtype} {_shape(w1)}")
        E_l, two_n, k_w1 = w1.shape
        if not (E_l > 0 and two_n > 0 and two_n % 2 == 0 and k_w1 == K):
            raise ValueError(f"w1 must be [E_l, 2I, K={K}] with E_l > 0 and an even 2I > 0, got "
                             f"{_shape(w1)}")
        N = two_n // 2
        if K % SCALE_BLOCK or N % SCALE_BLOCK:
            raise ValueError(f"hidden size K={K} and intermediate size I={N} must be multiples of "
                             f"{SCALE_BLOCK} (the 128x128 weight blocks and 1x128 activation "
                             "groups every backend uses)")
        if not (w2.dtype == FP8_DTYPE and w2.shape == (E_l, K, N)):
            raise ValueError(f"w2 must be float8_e4m3fn [E_l, K, I] = {(E_l, K, N)}, got "
                             f"{w2.dtype} {_shape(w2)}")
        if not (w1.is_contiguous() and w2.is_contiguous()):
            raise ValueError("w1 and w2 must be contiguous")
        for name, s, want in (("w1_scale", w1_scale, (E_l, 2 * N // SCALE_BLOCK, K // SCALE_BLOCK)),
                              ("w2_scale", w2_scale, (E_l, K // SCALE_BLOCK, N // SCALE_BLOCK))):
            if not (s.dtype == torch.float32 and s.shape == want):
                raise ValueError(f"{name} must be float32 {want} (128x128 blocks), got {s.dtype} "
                                 f"{_shape(s)}")
        if not (topk_ids.dim() == 2 and topk_ids.shape[0] == M and topk_ids.dtype in _ID_DTYPES):
            raise ValueError(f"topk_ids must be int32 or int64 [M={M}, k], got {topk_ids.dtype} "
                             f"{_shape(topk_ids)}")
        topk = topk_ids.shape[1]
        if topk < 1:
            raise ValueError("topk_ids must have k >= 1 columns")
        if not (topk_weights.dtype == torch.float32 and topk_weights.shape == (M, topk)):
            raise ValueError(f"topk_weights must be float32 {(M, topk)}, got {topk_weights.dtype} "
                             f"{_shape(topk_weights)}")
        if not (isinstance(global_num_experts, int) and global_num_experts >= E_l):
            raise ValueError(f"global_num_experts must be an int >= E_l={E_l}, got "
                             f"{global_num_experts!r}")
        device = x.device
        if expert_map is None:
            if global_num_experts != E_l:
                raise ValueError(f"without expert_map every expert is local: "
                                 f"global_num_experts={global_num_experts} must equal E_l={E_l}")
            same_device = (w1.device == device and w2.device == device
                           and topk_weights.device == device and topk_ids.device == device
                           and w1_scale.device == device and w2_scale.device == device)
        else:
            if not (isinstance(expert_map, torch.Tensor) and expert_map.dtype == torch.int32
                    and expert_map.shape == (global_num_experts,)):
                raise ValueError(
                    f"expert_map must be int32 [{global_num_experts}], got "
                    f"{getattr(expert_map, 'dtype', type(expert_map))} "
                    f"{_shape(expert_map) if isinstance(expert_map, torch.Tensor) else ''}")
            same_device = False  # the set below decides
        if apply_router_weight_on_input and topk != 1:
            raise ValueError(f"apply_router_weight_on_input needs topk == 1, got topk={topk}")
        if not same_device:
            tensors = [x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale]
            if expert_map is not None:
                tensors.append(expert_map)
            devices = {t.device for t in tensors}
            if len(devices) != 1:
                raise ValueError(f"all tensors must be on one device, got "
                                 f"{sorted(map(str, devices))}")
        if max_tokens_across_ranks is not None and not (
                isinstance(max_tokens_across_ranks, int) and max_tokens_across_ranks >= M):
            raise ValueError(f"max_tokens_across_ranks must be None or an int >= M={M}, got "
                             f"{max_tokens_across_ranks!r}")
        if not x.is_cuda or envs.VLLM_MOE_CHECK_IDS:
            check_routing_ranges(topk_ids, global_num_experts, expert_map, E_l)
