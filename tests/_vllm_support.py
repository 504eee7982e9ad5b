"""tests/vllm_support's modules, imported from a test. They import one another by plain name (they
also run as scripts inside vLLM's processes), so their folder is on sys.path while one loads."""

import importlib
import os
import sys
from types import ModuleType

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_support")


def import_support(name: str) -> ModuleType:
    """tests/vllm_support/<name>.py as a module (loaded once, as any import)."""
    sys.path.insert(0, SUPPORT)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(SUPPORT)
