"""What every command of ``vllm-moe-fixes`` shares: the usage error (exit status 2), the argument
types (decimal digits only, as environment values are) and the lazy torch import."""

from __future__ import annotations

import argparse
import math
import re

from vllm_moe_fixes import envs

TORCH_INSTALL = ("pip install torch (on a GPU machine, the CUDA build that matches its driver; "
                 "see the README's set-up)")


class UsageError(Exception):
    """A problem with the arguments or the environment: printed, exit status 2."""


# ------------------------------------------------------------------------------ argument types
# argparse reports a type's ArgumentTypeError as "argument --flag: <message>", exit status 2.
def int_at_least(minimum: int, maximum: int | None = None):
    """An argparse type: a decimal integer in [minimum, maximum] (digits only, like env values)."""
    allowed = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")

    def parse(text: str) -> int:
        try:
            value = envs.parse_decimal(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = allowed  # argparse names the type in some messages
    return parse


_DECIMAL_FLOAT = re.compile(r"\s*(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def positive_float(text: str) -> float:
    """An argparse type: a finite decimal number > 0 (no inf, nan, sign or ``_``)."""
    value = float(text) if _DECIMAL_FLOAT.fullmatch(text) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


SEED = int_at_least(0, 2**64 - 1)  # the range torch.Generator.manual_seed takes


def import_torch(command: str):
    """The torch module, or UsageError saying that ``command`` needs it and how to install it."""
    try:
        import torch
    except ImportError as e:
        raise UsageError(f"{command} needs torch, which is not installed ({e}): {TORCH_INSTALL}") \
            from None
    return torch
