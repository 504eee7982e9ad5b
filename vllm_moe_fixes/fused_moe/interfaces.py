"""The two roles a modular MoE layer is built from, and what passes between them.

A `PrepareAndFinalize` quantises (and, with expert parallelism, dispatches) a layer's input and
later combines the experts' output; an `Experts` runs the grouped GEMMs on what prepare produced
(`PrepareResult`), in the layout both declare (`ActivationFormat`). `FusedMoEModularKernel`
(modular_kernel.py) pairs one of each; the implementations live in role-named files
(no_ep_prepare_finalize.py, deepep_prepare_finalize.py, contiguous_experts.py,
batched_experts.py).
"""

from __future__ import annotations

import enum
import functools
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm_moe_fixes.sizes import cdiv


class Fp8MoEWeights(NamedTuple):
    """A layer's block-FP8 expert weights with their scales, as they travel together to the
    experts (E experts: all of them, or the E_l local ones; hidden size K, intermediate size I)."""

    w1: torch.Tensor        # float8_e4m3fn [E, 2I, K]: gate rows, then up rows
    w1_scale: torch.Tensor  # float32 [E, 2I/128, K/128]
    w2: torch.Tensor        # float8_e4m3fn [E, K, I]
    w2_scale: torch.Tensor  # float32 [E, K/128, I/128]


class ActivationFormat(enum.Enum):
    """STANDARD: one row per token [M', K]. BATCHED: one slice per local expert [E_l, T, K]."""

    STANDARD = "standard"
    BATCHED = "batched"


@dataclass
class PrepareResult:
    """What prepare hands to the experts.

    a1q: float8_e4m3fn, STANDARD [M', K] / BATCHED [E_l, T, K]; bfloat16 [M', K] from a prepare
        with defer_input_quant (the experts quantise it).
    a1q_scale: float32 [M', K/128] / [E_l, T, K/128] (any strides); None with defer_input_quant.
    topk_ids: STANDARD: int32/int64 [M', k] GLOBAL expert ids, -1 = not on this rank; None =
        keep the caller's. The kernel passes these to the experts and to finalize.
    topk_weights: STANDARD: float32 [M', k] (0 where the id is -1); None = keep the caller's.
    expert_num_tokens: BATCHED: int32 [E_l] valid rows per expert slice; None for STANDARD.
    handle: what this prepare's finalize needs (opaque), for finalize_async's ``handle`` when
        several prepares are in flight (two-batch overlap); None: nothing.
    """

    a1q: torch.Tensor
    a1q_scale: torch.Tensor | None
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    expert_num_tokens: torch.Tensor | None = None
    handle: object = None


class PrepareAndFinalize(ABC):
    """Quantise/dispatch before the experts, weight/reduce/combine after them.

    passes_reduced_output_through: True when finalize has nothing to do with an output the
    experts already reduced (no combine): the kernel then lets such experts write the layer's
    output directly, and finalize receives that same tensor.
    defer_input_quant: True when prepare hands the experts a1 unquantised (a1q bf16, a1q_scale
    None), for experts that quantise it themselves (`Experts.takes_unquantized_input`).
    use_ue8m0: the layer's activation scales, the one decision for every activation quant of a
    layer call: False, exact float32 scales (amax / 448); True, each rounded up to a power of
    two (UE8M0 values, still float32: what vLLM's quant does where DeepGEMM's E8M0 recipe is on,
    vllm.utils.deep_gemm.is_deep_gemm_e8m0_used()). prepare's quant (or the dispatch's FP8 cast)
    follows it, and the kernel passes it to the experts' apply, whose quants (a deferred input's,
    SiLU-and-mul's requant) follow it too.
    """

    activation_format: ActivationFormat = ActivationFormat.STANDARD
    passes_reduced_output_through: bool = False
    defer_input_quant: bool = False
    use_ue8m0: bool = False

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

        output_is_reduced is keyword-only and new in this signature: a subclass whose finalize
        does not take it still runs, with experts that do not reduce (the kernel then calls it
        without the keyword); the kernel refuses to pair it with reducing experts, whose output
        such a finalize would sum a second time.

        fused_expert_output: STANDARD: [M', K] already weighted and summed over the k slots when
        output_is_reduced (the experts' `reduces_output`; it may be `output` itself when
        passes_reduced_output_through), else [M', k, K] one row per slot, unreduced (slots with
        id -1 exact zeros; may be modified in place). BATCHED: [E_l, T, K] (output_is_reduced is
        False). topk_weights / topk_ids are PrepareResult's when it gave them, else the caller's.
        apply_router_weight_on_input: the weights went on the input; an unreduced output is then
        summed without them.
        """

    def supports_async(self) -> bool:
        """Whether prepare_async / finalize_async return before their transfer completes (and
        several prepares may be in flight, each finalize given its prepare's handle). Default:
        False, the two run prepare / finalize at once."""
        return False

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None,
                      apply_router_weight_on_input: bool) -> Callable[[], PrepareResult]:
        """Start prepare (same arguments) and return its receiver: ``receiver()`` waits for the
        transfer and returns what prepare would have (with ``handle`` set where finalize needs
        one). Nothing is read on the host that prepare does not read. The inputs must stay
        untouched until the receiver returns. Default: prepare now."""
        result = self.prepare(a1, topk_weights, topk_ids, num_experts, expert_map,
                              apply_router_weight_on_input)
        return lambda: result

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool, *, output_is_reduced: bool = False,
                       handle: object = None) -> Callable[[], None]:
        """Start finalize (same arguments) and return its receiver: output is written when
        ``receiver()`` returns. handle: the PrepareResult.handle of this micro-batch's prepare
        (None: the last prepare's). fused_expert_output must stay untouched until then.
        Default: finalize now (handle must be None)."""
        if handle is not None:
            raise ValueError(f"{type(self).__name__} keeps one prepare's state at a time: "
                             "finalize_async takes no handle (supports_async() is False)")
        # a finalize written before output_is_reduced takes no such keyword (see finalize)
        reduced = {"output_is_reduced": True} if output_is_reduced else {}
        self.finalize(output, fused_expert_output, topk_weights, topk_ids,
                      apply_router_weight_on_input, **reduced)
        return completed

    def max_num_tokens_per_rank(self) -> int | None:
        """Upper bound on tokens per rank per call (sizes batched layouts), or None."""
        return None

    def num_dispatchers(self) -> int:
        """Ranks that send tokens to this one."""
        return 1

    def num_chunks(self, num_tokens: int, chunk_size: int, max_tokens_across_ranks: int | None,
                   *, capturing: bool = False, refusal: BaseException | None = None,
                   micro_batches: int = 1) -> int:
        """Dispatch chunks for a call of num_tokens tokens, at most chunk_size tokens each.

        Every rank of an expert-parallel group must return the same number (each pass is one
        dispatch and one combine); a rank with fewer tokens runs empty passes. capturing: a CUDA
        graph capture is under way (nothing may be read on the host). Default: one rank
        cdiv(num_tokens, chunk_size), whatever max_tokens_across_ranks says (there is nobody to
        keep in step with); several, cdiv(max_tokens_across_ranks, chunk_size) when the caller
        gives the group's maximum, else one pass (no count is agreed without a collective: an
        expert-parallel subclass overrides this).

        micro_batches: each pass runs as this many dispatches and combines (the kernel's
        two-batch overlap), for a subclass that counts the dispatches of a call; the pass count
        does not depend on it.

        refusal: this rank's error for the call (the kernel's checks refused it). A subclass
        that agrees something across the group here joins that agreement carrying it, so that
        every rank raises (DeepEP's: CollectiveRefusal), and raises; one that agrees nothing
        raises it at once, as the default does.
        """
        if refusal is not None:
            raise refusal
        if self.num_dispatchers() == 1:
            return cdiv(num_tokens, chunk_size)
        if max_tokens_across_ranks is not None:
            return cdiv(max_tokens_across_ranks, chunk_size)
        return 1

    def check_capturable(self) -> None:
        """Raise ValueError when a pass cannot be captured in a CUDA graph (the kernel calls this
        before anything of a captured call runs). Default: it can."""


def completed() -> None:
    """The receiver of a transfer that has completed (nothing left to wait for)."""


class AsyncPrepareAndFinalize(PrepareAndFinalize):
    """A PrepareAndFinalize whose transfers run asynchronously: subclasses implement
    prepare_async and finalize_async, and prepare / finalize are those, waited for at once (one
    implementation of each step)."""

    def supports_async(self) -> bool:
        return True

    @abstractmethod
    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input) -> Callable[[], PrepareResult]:
        """PrepareAndFinalize.prepare_async."""

    @abstractmethod
    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, *, output_is_reduced: bool = False,
                       handle: object = None) -> Callable[[], None]:
        """PrepareAndFinalize.finalize_async."""

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input) -> PrepareResult:
        return self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                  apply_router_weight_on_input)()

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, *, output_is_reduced: bool = False,
                 handle: object = None) -> None:
        self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                            apply_router_weight_on_input, output_is_reduced=output_is_reduced,
                            handle=handle)()


class Experts(ABC):
    """Grouped FP8 expert GEMMs: GEMM1 (w1) -> SiLU(gate) * up -> GEMM2 (w2).

    reduces_output: True when apply also weights and sums each token's k slots (STANDARD only):
    out_shape is then [M', K] and finalize gets output_is_reduced=True.
    takes_unquantized_input: True when apply also takes a1q bf16 [M, K] with a1q_scale None and
    quantises it itself (the pairing of a prepare/finalize with defer_input_quant). Under
    torch.compile an apply decorated with `one_op_when_compiled` (end of this module) is one
    opaque op in the graph. apply's keyword use_ue8m0 is the prepare/finalize's (the kernel
    passes it to an apply that takes it, and refuses experts whose apply does not take it with a
    prepare/finalize that sets it).
    """

    activation_format: ActivationFormat = ActivationFormat.STANDARD
    reduces_output: bool = False
    takes_unquantized_input: bool = False

    @abstractmethod
    def workspace_shapes(self, M: int, I: int, K: int, topk: int, local_num_experts: int, *,
                         experts_pass_tokens: int | None = None) -> tuple[tuple[int, ...],
                                                                      tuple[int, ...],
                                                                      tuple[int, ...]]:
        """Element shapes (ws13, ws2, out) of the bf16 workspaces and of the experts' output.

        M: rows of a1q (STANDARD) or T, rows per expert slice (BATCHED); I: intermediate size
        (w1 [E_l, 2I, K], w2 [E_l, K, I]); K: hidden size; topk: k; local_num_experts: E_l;
        experts_pass_tokens: the most tokens one pass of apply may take (the kernel passes
        VLLM_FUSED_MOE_CHUNK_SIZE, read once per layer call), None = no bound; apply gets the
        same value.
        """

    @abstractmethod
    def apply(self, output: torch.Tensor, a1q: torch.Tensor, a1q_scale: torch.Tensor,
              weights: Fp8MoEWeights, *, workspace13: torch.Tensor, workspace2: torch.Tensor,
              topk_ids: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
              expert_num_tokens: torch.Tensor | None = None,
              topk_weights: torch.Tensor | None = None, expected_m: int | None = None,
              experts_pass_tokens: int | None = None, activation: str = "silu",
              use_ue8m0: bool = False) -> None:
        """Write output (out_shape, bf16): a view of the start of workspace13's storage, or the
        layer's output when the experts reduce and finalize passes it through.

        a1q / a1q_scale: PrepareResult's; weights: the E_l local experts' (w1 fp8 [E_l, 2I, K],
        w1_scale f32 [E_l, 2I/128, K/128], w2 fp8 [E_l, K, I], w2_scale f32 [E_l, K/128, I/128]);
        workspace13 / workspace2 bf16 views of the declared shapes (contents undefined on
        entry); topk_ids int32/int64 [M', k] global ids (STANDARD); expert_map int32 [E] or None;
        expert_num_tokens int32 [E_l] (BATCHED); topk_weights float32 [M', k] to weight the slots
        by when the experts reduce (None: plain sum, the weights went on the input); expected_m:
        average rows per local expert the dispatch can produce (BATCHED tiling hint), None =
        unknown; experts_pass_tokens: workspace_shapes' (None = one pass); activation "silu";
        use_ue8m0: the scales of the activation quants apply computes, rounded up to powers of
        two (PrepareAndFinalize.use_ue8m0). STANDARD: slots of non-local experts contribute exact
        zeros.
        """


# ------------------------------------------------------------------ an Experts in a traced graph
# The experts' apply as one torch custom op, for code that torch.compile traces.
#
# Dynamo traces Python. An experts' apply launches Triton or DeepGEMM kernels on CUDA tensors and
# runs torch references on CPU ones, whose shapes follow the routing (a boolean mask, a range
# check read on the host): a full graph cannot hold those. Under `torch.compiler.is_compiling()`
# the experts hand their apply to the op `vllm_moe_fixes::experts_apply` instead: the graph holds
# one opaque call that writes `output` and the two workspaces, and at run time the op calls the
# eager apply of an experts object of the same class. So a compiled experts is its class: our
# experts classes hold no state, and a class that is to run compiled must be importable by its
# module and qualified name and build without arguments.

_INSTANCES: dict[str, object] = {}  # "module:qualname" -> the experts object the op runs


def _experts_named(name: str):
    experts = _INSTANCES.get(name)
    if experts is None:
        module, qualname = name.split(":")
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        experts = _INSTANCES[name] = cls()
    return experts


@torch.library.custom_op("vllm_moe_fixes::experts_apply",
                         mutates_args=("output", "workspace13", "workspace2"))
def _experts_apply(experts: str, output: torch.Tensor, a1q: torch.Tensor,
                   a1q_scale: torch.Tensor, w1: torch.Tensor, w1_scale: torch.Tensor,
                   w2: torch.Tensor, w2_scale: torch.Tensor, workspace13: torch.Tensor,
                   workspace2: torch.Tensor, topk_ids: torch.Tensor | None,
                   expert_map: torch.Tensor | None, expert_num_tokens: torch.Tensor | None,
                   topk_weights: torch.Tensor | None, expected_m: int | None,
                   experts_pass_tokens: int | None, activation: str, use_ue8m0: bool) -> None:
    _experts_named(experts).apply(
        output, a1q, a1q_scale, Fp8MoEWeights(w1, w1_scale, w2, w2_scale),
        workspace13=workspace13, workspace2=workspace2, topk_ids=topk_ids,
        expert_map=expert_map, expert_num_tokens=expert_num_tokens, topk_weights=topk_weights,
        expected_m=expected_m, experts_pass_tokens=experts_pass_tokens, activation=activation,
        use_ue8m0=use_ue8m0)


@_experts_apply.register_fake
def _(experts, output, a1q, a1q_scale, w1, w1_scale, w2, w2_scale, workspace13, workspace2,
      topk_ids, expert_map, expert_num_tokens, topk_weights, expected_m, experts_pass_tokens,
      activation, use_ue8m0) -> None:
    return None  # writes its mutable arguments only


def one_op_when_compiled(apply):
    """Decorates an Experts.apply: while torch.compile traces it, the call becomes one call of
    the custom op above (the weights record travels as its four tensors: an op's schema takes
    tensors); otherwise ``apply`` runs as written."""

    @functools.wraps(apply)
    def apply_or_op(self, output, a1q, a1q_scale, weights, *, workspace13, workspace2,
                    topk_ids=None, expert_map=None, expert_num_tokens=None, topk_weights=None,
                    expected_m=None, experts_pass_tokens=None, activation="silu",
                    use_ue8m0=False) -> None:
        arguments = dict(workspace13=workspace13, workspace2=workspace2, topk_ids=topk_ids,
                         expert_map=expert_map, expert_num_tokens=expert_num_tokens,
                         topk_weights=topk_weights, expected_m=expected_m,
                         experts_pass_tokens=experts_pass_tokens, activation=activation,
                         use_ue8m0=use_ue8m0)
        if not torch.compiler.is_compiling():
            apply(self, output, a1q, a1q_scale, weights, **arguments)
            return
        cls = type(self)
        _experts_apply(f"{cls.__module__}:{cls.__qualname__}", output, a1q, a1q_scale,
                       **weights._asdict(), **arguments)

    return apply_or_op
