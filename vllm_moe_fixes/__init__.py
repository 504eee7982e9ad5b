"""Drop-in FP8 block-quantised Mixture-of-Experts layers with expert parallelism.

Subpackages, each re-exporting its public names:
    ops          Triton kernels, each with a torch reference (CPU tensors take the reference)
    fused_moe    the modular kernel (prepare/finalize x experts) and routing
    distributed  all-to-all buffers (DeepEP, or its API on torch.distributed) and DeepEP sizing
    worker       dummy (profile) run input randomisation
    integrations the vLLM plugin (adapters to vLLM's modular-kernel ABCs; the only vllm importer)
Modules: ``envs`` (environment variables), ``sizes`` (buffer sizes, no torch), ``config`` and
``planner`` (model presets; load and memory of a DP/EP configuration, no torch), ``cli`` (the
``vllm-moe-fixes`` command), ``testing`` (what tests, benchmarks and users share to check a
layer: references, random FP8 weights, metrics). Private: ``_compat`` (the only importers of
deep_ep and deep_gemm), ``_validate`` (argument checks), ``_memory`` (peak device memory).

Importing the package imports no torch: `vllm-moe-fixes plan` runs without it.
"""

__version__ = "0.1.0"
