"""The fork server's one preload (`bench.harness.isolate`): it imports `isolate.PRELOAD` once for every worker.

The fork server itself swallows only an ImportError of a preloaded module; any other exception
kills it, and with it every worker of the run (graphpass's or not; seen with a module raising a
RuntimeError at import). Here a module that fails to import is left for each worker to import
again, which then reports the error as its result.
"""

import importlib

from bench.harness.isolate import PRELOAD

for _name in PRELOAD:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - the worker re-raises it where it is reported
        pass
