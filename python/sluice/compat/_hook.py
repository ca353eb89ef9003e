"""The import hook that makes ``import mooncake.engine`` give ``sluice.compat.mooncake``.

Activated either from code (``sluice.compat.mooncake.install()``) or, without touching the
program, by ``SLUICE_MOONCAKE_COMPAT=1``: the wheel puts ``sluice-mooncake-compat.pth`` in
site-packages, whose one line calls :func:`activate_from_env` at interpreter start-up (every
process, spawned workers and torchrun ranks included) and does nothing more when the variable
is unset.

No top-level ``mooncake`` package is installed: the name belongs to Mooncake's own wheels
(and to an unrelated PyPI project). A meta-path finder answers for ``mooncake.engine`` only;
for the parent ``mooncake`` it answers only when no real package of that name can be found,
with an empty stand-in package, so that Mooncake's other modules (the store, EP) stay its own
when it is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from typing import Optional

ENV_VAR = "SLUICE_MOONCAKE_COMPAT"
_PARENT = "mooncake"
_MODULE = "mooncake.engine"
_TARGET = "sluice.compat.mooncake"

log = logging.getLogger("sluice.compat.mooncake")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # a plain new module object

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == _PARENT:
            module.__doc__ = ("Stand-in 'mooncake' package of sluice's Mooncake compatibility hook "
                              f"({ENV_VAR}); it holds only mooncake.engine.")
            return
        # mooncake.engine: a module of its own that re-exports the facade, so that the
        # facade keeps its own __name__ and __spec__ (and reload / pickling stay sane).
        target = importlib.import_module(_TARGET)
        for name in target.__all__:
            setattr(module, name, getattr(target, name))
        module.__doc__ = target.__doc__
        module.__sluice_compat__ = True


class MooncakeFinder(importlib.abc.MetaPathFinder):
    """Answers ``mooncake.engine`` (and ``mooncake`` when no real one exists)."""

    def find_spec(self, fullname: str, path, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname == _MODULE:
            return importlib.machinery.ModuleSpec(fullname, _LOADER, origin=f"sluice-compat:{_TARGET}")
        if fullname == _PARENT:
            if importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
                return None  # Mooncake's own package is installed: it stays the parent
            spec = importlib.machinery.ModuleSpec(fullname, _LOADER, origin="sluice-compat", is_package=True)
            spec.submodule_search_locations = []
            return spec
        return None


_LOADER = _Loader()
_FINDER = MooncakeFinder()


def active() -> bool:
    return _FINDER in sys.meta_path


def install() -> None:
    """Make ``import mooncake.engine`` resolve to ``sluice.compat.mooncake`` in this process.
    Idempotent. A ``mooncake.engine`` imported before (Mooncake's own) is replaced in
    ``sys.modules``; objects made from it keep working as they were."""
    if not active():
        sys.meta_path.insert(0, _FINDER)
    old = sys.modules.get(_MODULE)
    if old is not None and not getattr(old, "__sluice_compat__", False):
        log.warning("install(): mooncake.engine was already imported (%s); later imports get the "
                    "Sluice facade, objects made from the old module stay Mooncake's",
                    getattr(old, "__file__", old))
        del sys.modules[_MODULE]


def uninstall() -> None:
    """Undo :func:`install`: later imports find Mooncake's own module again (if installed)."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    mod = sys.modules.get(_MODULE)
    if mod is not None and getattr(mod, "__sluice_compat__", False):
        del sys.modules[_MODULE]
    parent = sys.modules.get(_PARENT)
    if parent is not None and getattr(parent, "__spec__", None) is not None and parent.__spec__.loader is _LOADER:
        del sys.modules[_PARENT]


_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def activate_from_env() -> None:
    """Called by the .pth line at start-up: install the hook when SLUICE_MOONCAKE_COMPAT is on.
    Never raises (an exception in a .pth line would only print a confusing trace)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _OFF:
        return
    if value not in _ON:
        sys.stderr.write(f"sluice: {ENV_VAR}={os.environ.get(ENV_VAR)!r} is not 1/0 (true/false); "
                         "the Mooncake compatibility hook stays off\n")
        return
    try:
        install()
    except Exception as e:  # pragma: no cover - defensive
        sys.stderr.write(f"sluice: could not install the Mooncake compatibility hook: {e}\n")
