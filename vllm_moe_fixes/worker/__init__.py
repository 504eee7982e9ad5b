"""Engine-side helpers for dummy/profile runs."""

from vllm_moe_fixes.worker.dummy_run import maybe_randomize_inputs

__all__ = ["maybe_randomize_inputs"]
