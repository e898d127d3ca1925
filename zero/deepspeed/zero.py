"""`deepspeed.zero`: the same module object as `deepspeed.runtime.zero`, as in DeepSpeed (whose
deepspeed/__init__.py binds `zero` to `deepspeed.runtime.zero`).

Importing this file puts zero.deepspeed.runtime.zero in its place, so `zero.deepspeed.zero is
zero.deepspeed.runtime.zero` and both paths have the same names. A submodule imported through this
path (`import zero.deepspeed.zero.partition_parameters`) is runtime.zero's own module, not a second
copy with its own classes.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from zero.deepspeed.runtime import zero as _runtime_zero

_ALIAS, _REAL = __name__, _runtime_zero.__name__


class _SubmoduleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `zero.deepspeed.zero.<sub>` as the module `zero.deepspeed.runtime.zero.<sub>`."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(_ALIAS + ".") or importlib.util.find_spec(_REAL + fullname[len(_ALIAS):]) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder: exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        sys.modules[module.__name__] = importlib.import_module(_REAL + module.__name__[len(_ALIAS):])


if not any(isinstance(f, _SubmoduleAlias) for f in sys.meta_path):  # before the path finder, which would load a copy
    sys.meta_path.insert(0, _SubmoduleAlias())
sys.modules[__name__] = _runtime_zero  # the import statement returns what is here after this file ran
