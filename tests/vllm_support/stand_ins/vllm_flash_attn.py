"""Stand-in for ``vllm/vllm_flash_attn/__init__.py`` on a GPU machine without vLLM's compiled
flash-attention: every name vLLM imports from it exists, and calling one raises. The MoE checks
never run attention.
"""


def _unavailable(*args, **kwargs):
    raise RuntimeError("vllm_flash_attn is a stand-in here (no compiled flash-attention)")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable
