"""Dynamo-traceable stand-ins for library code that torch.compile cannot trace as written.

Each integration module registers its stand-ins with Dynamo (`register()`, idempotent) for
traced code only: eager calls of the library run its own code. `register_available()`, called
when graphpass is imported, registers each integration whose library is already imported, and
the others right after their library's module is first imported (the import itself unchanged),
so the order of imports does not matter and nothing is imported that the program does not import.
`substitute_in_graph` and `check_substitute` (`graphpass.integrations.substitutes`) do the same for a
user's own kernel.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

from graphpass.integrations.substitutes import check_substitute, substitute_in_graph

__all__ = ["check_substitute", "register_available", "register_now", "substitute_apply", "substitute_in_graph"]

log = logging.getLogger("graphpass")


def register_available() -> None:
    """Register the stand-ins of every library that is imported now or will be (idempotent)."""
    from graphpass.integrations import megatron, torch_distributed, trl, verl

    torch_distributed.register()
    _when_imported(megatron.MODULE, megatron.register_for)
    _when_imported(trl.MODULE, trl.register_for)
    _when_imported(verl.MODULE, verl.register_for)


def register_now(name: str, register_for) -> bool:
    """`register_for(module)` with module `name` imported (now, if it is not yet); False when it
    is not importable."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return False
    return register_for(module)


def substitute_apply(function, stand_in, registered: list, module, what: str) -> bool:
    """Have Dynamo trace `stand_in` for `function.apply` (an autograd.Function of `module`), once:
    `registered` (the integration's list) then holds `module`. False, logged, where another
    dispatch rule for the Function exists (`what` names it in the warning)."""
    if registered:
        return True
    from graphpass import _torch_api

    try:
        _torch_api.substitute_in_graph_apply(function, stand_in)
    except ValueError as error:  # another dispatch rule for the same Function
        log.warning("graphpass: %s stays unfused: %s", what, error)
        return False
    registered.append(module)
    return True


def _when_imported(name: str, register) -> None:
    """`register(module)` now if module `name` is imported, else right after its first import;
    nothing when its top-level package is not installed."""
    if name in sys.modules:
        _register(register, sys.modules[name])
    elif importlib.util.find_spec(name.partition(".")[0]) is not None and \
            not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, register))


def _register(register, module) -> None:
    # A library's import must not fail because a stand-in could not be registered.
    try:
        register(module)
    except Exception:  # noqa: BLE001 - logged; the library then runs as without graphpass
        log.warning("graphpass: could not register the stand-ins for %s", module.__name__, exc_info=True)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds module `name` as the other finders do and runs `register(module)` once it has executed."""

    def __init__(self, name: str, register):
        self.name, self.register = name, register

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the search below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            _register(self.register, module)

        loader.exec_module = exec_module  # this module's own loader instance
        return spec
