"""Integrations with inference engines; each subpackage is the only code that imports its engine.

    vllm   adapters to vLLM's modular MoE kernel ABCs and the ``vllm.general_plugins`` hook
"""
