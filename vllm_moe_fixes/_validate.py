"""Argument checks shared by the public edges of ops, fused_moe and distributed.

Each raises ValueError with a message that names the argument and the rule; none imports torch,
so the planner (pure Python) uses them too.
"""

from __future__ import annotations


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond holds."""
    if not cond:
        raise ValueError(msg)


def check_positive_int(name: str, value) -> None:
    """Raise ValueError unless `value` is an int >= 1 (bool is refused: True is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


def check_nonnegative_int(name: str, value, *, or_none: bool = False) -> None:
    """Raise ValueError unless `value` is an int >= 0 (bool refused), or None where `or_none`."""
    if or_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be {'None or ' if or_none else ''}an int >= 0")


def check_bool(name: str, value) -> None:
    """Raise ValueError unless `value` is a bool (1 and 0 are refused: a flag is not a count)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_experts_per_rank(num_experts: int, num_ranks: int) -> int:
    """Return E_l = num_experts // num_ranks; raise ValueError unless num_experts is a
    positive multiple of num_ranks (expert g lives on rank g // E_l)."""
    if num_experts < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by the number of ranks "
                         f"{num_ranks} (num_experts must be a positive multiple of the rank count)")
    return num_experts // num_ranks
