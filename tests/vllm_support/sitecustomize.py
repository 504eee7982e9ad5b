"""Imported at start-up by every Python process that has this folder on PYTHONPATH, vLLM's
spawned harness ranks included: registers this library's adapters in vLLM's modular-kernel test
harness once that harness is imported (mk_registration.py here). Only device_run.sh puts this
folder on PYTHONPATH: the library's own test runs never load it.
"""

import mk_registration

mk_registration.register_when_imported()
