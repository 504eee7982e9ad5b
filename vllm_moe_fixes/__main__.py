"""``python -m vllm_moe_fixes``: the ``vllm-moe-fixes`` command line (see vllm_moe_fixes.cli)."""

import sys

from vllm_moe_fixes.cli import main

if __name__ == "__main__":
    sys.exit(main())
