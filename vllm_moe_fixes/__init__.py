"""Drop-in FP8 block-quantised Mixture-of-Experts layers with expert parallelism.

Submodules: ``envs`` (backend toggles), ``ops`` (Triton kernels with torch references),
``fused_moe`` (the modular kernel, experts and prepare/finalize), ``distributed``
(all-to-all buffers and DeepEP sizing), ``worker`` (dummy-run input randomisation).
"""

__version__ = "0.1.0"
