"""The only modules that import the optional libraries deep_ep and deep_gemm.

Both raise ``MissingLibraryError`` when the configuration asks for a library that cannot be used
(not installed, or not importable): one exception type for "optional library missing", whose
message names the environment variable that asked for it and the library.
"""

from __future__ import annotations


class MissingLibraryError(ImportError):
    """An optional library the configuration asks for (``VLLM_USE_DEEP_GEMM=1``, a DeepEP
    ``VLLM_ALL2ALL_BACKEND``) is not installed or does not import. An ``ImportError``, as for any
    missing module; ``name`` is the module (``"deep_ep"``, ``"deep_gemm"``), the message names
    the environment variable and the library, and says what to do instead."""
