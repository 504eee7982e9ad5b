"""The shared Triton helpers: the host-side power of two against triton's, and the two device
roundings against torch's round-to-nearest-even casts on random, tie, subnormal and signed-zero
values (under the interpreter on CPU, compiled on a GPU), and the cached launch's keys."""

import types

import pytest
import torch
import triton
import triton.language as tl

from vllm_moe_fixes.ops import triton_utils as tu
from vllm_moe_fixes.ops.fp8 import FP8_DTYPE, FP8_MAX
from vllm_moe_fixes.ops.triton_utils import (
    next_power_of_2,
    round_to_bf16_grid,
    round_to_e4m3_grid,
)


def test_next_power_of_2_matches_triton():
    assert [next_power_of_2(n) for n in range(1, 5000)] == [
        triton.next_power_of_2(n) for n in range(1, 5000)]


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, E4M3: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < n, other=0.0)
    if E4M3:
        r = round_to_e4m3_grid(v)
    else:
        r = round_to_bf16_grid(v)
    tl.store(out_ptr + i, r, mask=i < n)


def _values(limit: float, n: int, seed: int) -> torch.Tensor:
    """float32: random magnitudes over many binades, both signs, +-0, and exact ties of the
    target grids (a bf16 ulp half-way point, e4m3 normal and subnormal half-way points)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n).uniform_(-14, 8.7, generator=g))
    v = mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    ties = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4, 2.0**-10,
            3 * 2.0**-10, 2.0**-7 + 2.0**-10, 0.0, -0.0, limit, -limit]
    v = torch.cat([v, torch.tensor(ties), -torch.tensor(ties)])
    return v.clamp(-limit, limit)


@pytest.mark.parametrize("e4m3", [True, False])
@pytest.mark.parametrize("n", [1, 1000])
def test_roundings_match_torch_casts(e4m3, n, kernel_device):
    v = _values(FP8_MAX if e4m3 else 3e38, n, seed=n)
    want = v.to(FP8_DTYPE if e4m3 else torch.bfloat16).float()
    out = torch.full_like(v, float("nan"), device=kernel_device)
    _round_kernel[(triton.cdiv(v.numel(), 256),)](v.to(kernel_device), out, v.numel(),
                                                 E4M3=e4m3, BLOCK=256)
    got = out.cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 keeps its sign


def test_launch_keys_separate_what_triton_specialises():
    """Arguments that Triton compiles differently get different key entries: integers equal to
    1, multiples of 16, 64-bit and negative 64-bit; tensor dtypes and 16-byte alignment; a bool
    from the int of the same value; constexpr values. Equal specialisations share an entry."""
    ints = [1, 2, 16, 32, 2**31, -2**31 - 1, 2**63]
    assert len({tu._arg_class(v) for v in ints}) == len(ints) - 1  # 16 and 32 alike
    assert tu._arg_class(7) == tu._arg_class(9) and tu._arg_class(0) == tu._arg_class(48)
    assert tu._arg_class(True) != tu._arg_class(1) and tu._arg_class(False) != tu._arg_class(0)
    assert tu._arg_class(None) != tu._arg_class(False) and tu._arg_class(1.0) == tu._arg_class(0.5)
    buf = torch.empty(64, dtype=torch.uint8)
    aligned = buf[16 - buf.data_ptr() % 16:]
    assert tu._arg_class(aligned) != tu._arg_class(aligned[1:])
    assert tu._arg_class(aligned) != tu._arg_class(aligned.view(torch.int8))
    assert tu._arg_class(aligned[16:]) == tu._arg_class(aligned)


class _Compiled:
    """Stands in for a CompiledKernel: records the launches its launcher (run) receives."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class _Kernel:
    """Stands in for a @triton.jit kernel: kernel[grid](*args) records the call and returns a new
    compiled kernel, as Triton's JIT entry does; params say which parameters are constexprs
    (by default: a tensor, an int, a float, a constexpr)."""

    __name__ = "_fake_kernel"

    def __init__(self, constexpr=(False, False, False, True)):
        self.jit, self.compiled = [], []
        self.params = [types.SimpleNamespace(is_constexpr=c) for c in constexpr]

    def __getitem__(self, grid):
        def first(*args, num_warps, **options):
            self.jit.append((grid, args, num_warps, options))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return first


@pytest.fixture
def compiled_mode(monkeypatch):
    """The launchers as on a GPU (not interpreting), with device 0 and stream 1000 + device."""
    device = [0]
    monkeypatch.setattr(tu, "INTERPRETING", False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: device[0], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1000 + d,
                        raising=False)
    return device


def _aligned(nbytes, dtype=torch.uint8):
    """A CPU tensor whose data pointer is a multiple of 16 bytes."""
    buf = torch.empty(nbytes + 16, dtype=torch.uint8)
    return buf[(-buf.data_ptr()) % 16:][:nbytes].view(dtype)


def test_launcher_goes_through_triton_once_per_specialisation(compiled_mode):
    """The first launch goes through kernel[grid] with the tensors; a repeat, and a new value of
    the same class (M=5 after M=7), call the compiled kernel's launcher with the grid, the
    current stream, the data pointers and every scalar, without Triton."""
    kernel = _Kernel()
    launcher = tu.KernelLauncher(kernel, enable_fp_fusion=False)
    x = _aligned(64, torch.float32)
    launcher((2, 1, 1), 4, (x,), (7, 1e-10, True))
    assert kernel.jit == [((2, 1, 1), (x, 7, 1e-10, True), 4, {"enable_fp_fusion": False})]
    launcher((3, 2, 1), 4, (x,), (7, 1e-10, True))
    launcher((1, 1, 1), 4, (x,), (5, 1e-10, True))
    assert len(kernel.jit) == 1
    assert kernel.compiled[0].launches == [
        (3, 2, 1, 1000, "fn", "meta", None, None, None, x.data_ptr(), 7, 1e-10, True),
        (1, 1, 1, 1000, "fn", "meta", None, None, None, x.data_ptr(), 5, 1e-10, True)]


def test_launcher_new_specialisation_is_compiled_not_served_stale(compiled_mode):
    """Each argument change that Triton compiles differently goes through Triton once: a key
    too coarse in any part (device, num_warps, dtype, 16-byte alignment, runtime integer class,
    constexpr value) fails here."""
    kernel = _Kernel(constexpr=(False, False, False, True, True))
    launcher = tu.KernelLauncher(kernel)
    x = _aligned(4096, torch.float32)
    base = ((x,), (7, 1e-10, True, 128))
    changes = [
        ((x[16:],), (7, 1e-10, True, 128)),        # 64 bytes on: still aligned -> same kernel
        ((x[1:],), (7, 1e-10, True, 128)),         # 4 bytes on: not 16-byte aligned
        ((x.view(torch.int32),), (7, 1e-10, True, 128)),  # another dtype
        ((x,), (1, 1e-10, True, 128)),             # an int equal to 1
        ((x,), (32, 1e-10, True, 128)),            # a multiple of 16
        ((x,), (2**31, 1e-10, True, 128)),         # a 64-bit int
        ((x,), (7, 1e-10, False, 128)),            # a constexpr bool
        ((x,), (7, 1e-10, True, 1024)),            # a constexpr int of 128's int class
    ]
    launcher((1, 1, 1), 4, *base)
    for tensors, scalars in changes:
        launcher((1, 1, 1), 4, tensors, scalars)
    assert len(kernel.jit) == 1 + len(changes) - 1  # all but the aligned view compile anew
    launcher((1, 1, 1), 8, *base)                     # num_warps
    compiled_mode[0] = 1
    launcher((1, 1, 1), 4, *base)                     # another device
    assert len(kernel.jit) == len(changes) + 2
    assert [c.launches[-1][3] for c in kernel.compiled if c.launches] == [1000]


def test_launcher_hooks_see_every_launch(compiled_mode, monkeypatch):
    kernel = _Kernel(constexpr=(False, False))
    launcher = tu.KernelLauncher(kernel)
    x = _aligned(64, torch.float32)
    launcher((1, 1, 1), 4, (x,), (7,))
    monkeypatch.setattr(tu, "_hooked", lambda: True)
    launcher((1, 1, 1), 4, (x,), (7,))
    launcher((1, 1, 1), 4, (x,), (7,))
    assert len(kernel.jit) == 3 and not any(c.launches for c in kernel.compiled)


def test_launcher_by_value_cache_is_bounded(compiled_mode, monkeypatch):
    """Past _MAX_BY_VALUE entries the by-value cache empties; the by-class cache still serves
    the compiled kernel, so Triton runs once."""
    monkeypatch.setattr(tu, "_MAX_BY_VALUE", 4)
    kernel = _Kernel(constexpr=(False, False))
    launcher = tu.KernelLauncher(kernel)
    x = _aligned(64, torch.float32)
    for m in range(3, 40, 2):
        launcher((1, 1, 1), 4, (x,), (m,))
    assert len(kernel.jit) == 1 and len(launcher._by_value) <= 4
    assert len(kernel.compiled[0].launches) == len(range(3, 40, 2)) - 1


def test_launcher_refuses_a_tensor_among_the_scalars(compiled_mode):
    x = _aligned(64, torch.float32)
    with pytest.raises(ValueError, match="_fake_kernel: a tensor among the scalar arguments"):
        tu.KernelLauncher(_Kernel())((1, 1, 1), 4, (x,), (7, x))


def test_launch_splits_the_leading_tensors(compiled_mode, monkeypatch):
    """launch(kernel, grid, args, ...) pads the grid to 3, passes the leading tensors as tensors
    and keeps one launcher per kernel and options."""
    monkeypatch.setattr(tu, "_LAUNCHERS", {})
    kernel, x = _Kernel((False, False, False, True)), _aligned(64, torch.float32)
    tu.launch(kernel, (2,), (x, x, 5, True), 4, enable_fp_fusion=False)
    tu.launch(kernel, (3, 2), (x, x, 7, True), 4, enable_fp_fusion=False)
    assert kernel.jit == [((2, 1, 1), (x, x, 5, True), 4, {"enable_fp_fusion": False})]
    assert kernel.compiled[0].launches == [
        (3, 2, 1, 1000, "fn", "meta", None, None, None, x.data_ptr(), x.data_ptr(), 7, True)]
    tu.launch(kernel, (1,), (x, x, 7, True), 4)  # other options: another launcher
    assert len(kernel.jit) == 2 and len(tu._LAUNCHERS) == 2


class _Wrapper:
    """Stands in for Triton's CudaLauncher: the C launch function as `launch`, the metadata the
    direct call reads, and a __call__ that must not be used when the direct call applies."""

    launch_cooperative_grid, launch_pdl = False, True
    arg_annotations, kernel_signature = "annotations", b"sig"

    def __init__(self, scratch=0):
        self.global_scratch_size = self.profile_scratch_size = scratch
        self.launches, self.wrapped = [], []

    def launch(self, *args):
        self.launches.append(args)

    def __call__(self, *args):
        self.wrapped.append(args)


class _WrappedCompiled:
    function, packed_metadata = "fn", (4, 1, 0)

    def __init__(self, scratch=0):
        self.run = _Wrapper(scratch)


@pytest.mark.parametrize("version", [(3, 6), (3, 9), (3, 7)])
def test_direct_launch_argument_layouts(version, monkeypatch):
    """The C launch gets what Triton's wrapper would hand it: triton 3.6 every argument flat
    after (scratch, scratch, metadata, launch metadata, hooks); 3.9 (metadata, launch metadata,
    hooks, scratch, scratch, annotations, signature, the arguments as a tuple). Another version,
    or a kernel with scratch memory, goes through the wrapper."""
    monkeypatch.setattr(tu, "_TRITON_VERSION", version)
    compiled = _WrappedCompiled()
    tu._direct_launch(compiled)(2, 3, 1, 77, 1000, 7, True)
    head = (2, 3, 1, 77, "fn", False, True)
    want = {(3, 6): head + (None, None, (4, 1, 0), None, None, None, 1000, 7, True),
            (3, 9): head + ((4, 1, 0), None, None, None, None, None, "annotations", b"sig",
                            (1000, 7, True))}
    if version in want:
        assert compiled.run.launches == [want[version]] and not compiled.run.wrapped
    else:
        assert compiled.run.wrapped == [(2, 3, 1, 77, "fn", (4, 1, 0), None, None, None, 1000, 7,
                                         True)] and not compiled.run.launches
    scratch = _WrappedCompiled(scratch=256)
    tu._direct_launch(scratch)(1, 1, 1, 77, 1000)
    assert scratch.run.wrapped and not scratch.run.launches


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * factor, mask=i < n)


@pytest.mark.gpu
def test_gpu_launcher_matches_triton_jit():
    """On the GPU the cached launch (second and later calls) writes what kernel[grid] writes, for
    a new n of the same class, another dtype and a misaligned view in between."""
    launcher = tu.KernelLauncher(_scale_kernel)
    base = torch.randn(5000, device="cuda")
    for x in (base[:1000], base[:1000], base[:777], base.half()[:1000], base[1:1001], base[:1000]):
        n = x.numel()
        want = torch.full_like(x, float("nan"))
        _scale_kernel[(triton.cdiv(n, 256),)](x, want, n, 0.37, BLOCK=256)
        got = torch.full_like(x, float("nan"))
        launcher((triton.cdiv(n, 256), 1, 1), 4, (x, got), (n, 0.37, 256))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_kernel_without_params_keys_every_scalar_by_value(compiled_mode):
    """Where a kernel does not list its parameters, a new value of any scalar is a new kernel
    (nothing is known to be a runtime int)."""
    kernel = _Kernel()
    del kernel.params
    launcher = tu.KernelLauncher(kernel)
    x = _aligned(64, torch.float32)
    launcher((1, 1, 1), 4, (x,), (7,))
    launcher((1, 1, 1), 4, (x,), (9,))
    assert len(kernel.jit) == 2


def _triton_binder(kernel):
    """(the JITFunction of kernel, Triton's own binder for it): the binder gives the
    specialisation of a call (the argument part of the compile-cache key) for an sm_90 target.
    Skips where this Triton's internals differ."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import JITFunction, create_function_from_signature
        backend = CUDABackend(GPUTarget("cuda", 90, 32))
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
        return jit, create_function_from_signature(jit.signature, jit.params, backend)
    except (ImportError, AttributeError, TypeError) as e:
        pytest.skip(f"Triton's binder is not reachable here: {e!r}")


def _ops_kernels():
    from vllm_moe_fixes.ops.activation import _silu_and_mul_kernel
    from vllm_moe_fixes.ops.fp8_quant import _per_token_group_quant_fp8_kernel
    from vllm_moe_fixes.ops.moe_sum import _moe_sum_kernel
    from vllm_moe_fixes.ops.silu_mul_quant import _silu_and_mul_quant_fp8_kernel
    return [(_silu_and_mul_kernel, 2), (_per_token_group_quant_fp8_kernel, 3),
            (_moe_sum_kernel, 3), (_silu_and_mul_quant_fp8_kernel, 4)]


# integers by what Triton's specialisation of a runtime int reads (_int_class): a sibling of a
# value is another value of its class
_INT_SIBLINGS = [[1], [2, 7, 1001], [16, 128, 1024, 7168], [2**31 + 1, 2**31 + 3],
                 [2**31 + 16, 2**32]]


def _sibling(v, pick):
    if type(v) is float:  # noqa: E721
        return pick([1e-10, 0.5])
    if type(v) is int:  # noqa: E721
        return pick(next(s for s in _INT_SIBLINGS if v in s))
    return v


@pytest.mark.parametrize("index", range(4))
def test_class_keys_follow_tritons_specialisation(index):
    """For the ops' kernels: random argument sets, and each with one scalar replaced by another
    value of its runtime class (7 -> 1001, 128 -> 1024, 0.5 -> 1e-10): where the two by-class keys
    are equal, Triton's own binder gives equal specialisations. A key too coarse anywhere (e.g.
    a constexpr BLOCK of 128 and of 1024 under one key) fails here."""
    kernel, num_tensors = _ops_kernels()[index]
    jit, binder = _triton_binder(kernel)  # a JITFunction also under the interpreter
    launcher = tu.KernelLauncher(jit)
    flags = tu._constexpr_flags(jit)[num_tensors:]
    g = torch.Generator().manual_seed(index)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]  # noqa
    compared = 0
    for _ in range(200):
        tensors = tuple(_aligned(64, pick([torch.bfloat16, torch.float32]))[pick([0, 0, 1]):]
                        for _ in range(num_tensors))
        scalars = [pick([False, True]) if const and pick([0, 1]) else
                   pick([1e-10, 0.5]) if not const and pick([0, 0, 1]) else
                   pick(pick(_INT_SIBLINGS)) for const in flags]
        i = pick(range(len(scalars)))
        sibling = [*scalars[:i], _sibling(scalars[i], pick), *scalars[i + 1:]]
        keys = [launcher._class_key(0, 4, tensors, tuple(s)) for s in (scalars, sibling)]
        if keys[0] == keys[1]:
            compared += 1
            specs = [binder(*tensors, *s, num_warps=4)[1] for s in (scalars, sibling)]
            assert specs[0] == specs[1], (i, scalars[i], sibling[i])
    assert compared > 50
