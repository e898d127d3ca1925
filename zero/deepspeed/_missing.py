"""Every public name of DeepSpeed's modules, importable from zero.deepspeed; what to say about those
zero does not have.

[Note: the name list]
public_names.txt, generated from an installed DeepSpeed by tools/deepspeed_names.py, lists every
module path of DeepSpeed and every public name of each module with its kind. It decides what
`zero.deepspeed` answers for, so a DeepSpeed script finds every name it imports:
- a listed module path `deepspeed.a.b` imports as `zero.deepspeed.a.b`: zero's own file where there
  is one, else an _AbsentModule made on import by `_AbsentPackages`, unless it lies in the package
  of a feature zero lacks altogether (ABSENT_PACKAGES: `deepspeed.moe`, `deepspeed.inference`, ...;
  see [Note: the feature table] in zero/features.py): that import raises ImportError with the
  reason, so a `try: import deepspeed.moe` probe takes the branch without it. A file of zero's that
  stands for a DeepSpeed package answers `__path__` (through `missing`), so DeepSpeed's other
  modules under it import too;
- a listed name is zero's own object where zero has the feature: defined in that file, or, for a
  class or function DeepSpeed re-exports, in zero's file for the module that defines it or for
  another module that re-exports it (`deepspeed.zero.Init` is zero.init.Init under every path).
  Else a literal constant is its recorded value, a logger is zero's logger, a module bound under
  another name (`deepspeed.zero`, `dist`) is that module, and anything else is a stand-in (see
  [Note: absent names]);
- any other name (a typo, a private name) is an AttributeError, and any other path an ImportError,
  at once, as for any module.
Every file of zero/deepspeed/ ends with `def __getattr__(name): return missing(__name__, name)`, which
answers for the names the file does not define. Importing a module binds it on its package, as
everywhere: a file of zero's for a DeepSpeed package keeps its own names clear of its DeepSpeed
modules' names (`torch`, `logging` and `builder` are modules of DeepSpeed packages).

[Note: absent names]
A DeepSpeed script often imports more than it uses (`from deepspeed.runtime.zero import TiledLinear`
at the top of a file that never builds one). So a DeepSpeed name that zero lacks imports fine and
fails when used: it resolves to a stand-in class whose call, attribute access or instantiation of
a subclass raises `NotAvailableError` with the reason and what to use instead. (A module zero has
no file for in the package of a feature zero lacks altogether raises ImportError on import
instead; see [Note: the name list].) `isinstance(x, StandIn)` is simply False. The reason is the
name's entry in ABSENT_NAMES, else that of the nearest package in ABSENT_PACKAGES that holds it (or
holds the module DeepSpeed defines it in), else a general sentence pointing to
docs/migrating-from-deepspeed.md.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading
import types
from pathlib import Path
from typing import NamedTuple

from zero.features import absent_names, absent_packages

# DeepSpeed packages zero lacks (or has in part), and single names it lacks, with what to use instead:
# from the one feature table (see [Note: the feature table] in zero/features.py)
ABSENT_PACKAGES = absent_packages()
ABSENT_NAMES = absent_names()

_HERE = Path(__file__).resolve().parent

# what a listed name without an entry above says, when no absent package holds it either
GENERAL_REASON = ("zero has no counterpart of this part of DeepSpeed; docs/migrating-from-deepspeed.md lists what "
                  "zero provides and what to use instead")


class Listed(NamedTuple):
    """One public name of a DeepSpeed module (a line of public_names.txt).

    Args:
        kind: "class", "function", "module", "logger", "value" (any other object) or "constant".
        value: a constant's value; the module path of a "module"; for a "class" or "function" that
            the module re-exports, the full name where DeepSpeed defines it (else None).
    """

    kind: str
    value: object = None


@functools.cache
def _blocks() -> dict[str, list[str]]:
    """public_names.txt's lines by module path (read once, parsed per module when asked)."""
    blocks: dict[str, list[str]] = {}
    block: list[str] = []
    for line in Path(__file__).with_name("public_names.txt").read_text().splitlines():
        if line.startswith(" "):
            block.append(line)
        elif line and not line.startswith("#"):
            block = blocks[line] = []
    return blocks


@functools.cache
def module_names(path: str) -> dict[str, Listed]:
    """The public names of DeepSpeed's module `path` (`deepspeed.utils`); empty for a path not listed."""
    names = {}
    for line in _blocks().get(path, ()):
        name, _, tail = line.strip().partition(" ")
        if tail.startswith("= "):
            names[name] = Listed("constant", ast.literal_eval(tail[2:]))
        else:
            kind, _, where = tail.partition(" ")
            names[name] = Listed(kind, where or None)
    return names


def deepspeed_modules() -> dict[str, dict[str, Listed]]:
    """DeepSpeed's module paths, each with its public names (see [Note: the name list])."""
    return {path: module_names(path) for path in _blocks()}


@functools.cache
def engine_members() -> dict[str, str]:
    """The public members of DeepSpeed's DeepSpeedEngine that torch.nn.Module lacks, each with its kind
    ("method", "property", "staticmethod", "classmethod" or "value"), from engine_members.txt."""
    lines = Path(__file__).with_name("engine_members.txt").read_text().splitlines()
    return dict(line.split(" ", 1) for line in lines if line and not line.startswith("#"))


@functools.cache
def _module_paths() -> frozenset[str]:
    """The DeepSpeed module paths zero.deepspeed imports: the listed ones, and those of ABSENT_NAMES (from
    older DeepSpeed versions) with their packages."""
    older = {".".join(full.split(".")[:n]) for full in ABSENT_NAMES for n in range(2, full.count(".") + 1)}
    return frozenset(_blocks()) | older


@functools.cache
def _packages() -> frozenset[str]:
    """The module paths that hold other modules (zero's file for one answers `__path__`)."""
    return frozenset(path.rpartition(".")[0] for path in _module_paths())


@functools.cache
def _own_paths() -> frozenset[str]:
    """The DeepSpeed module paths zero has a file for (zero/deepspeed/**/*.py)."""
    paths = set()
    for file in _HERE.rglob("*.py"):
        parts = file.relative_to(_HERE.parent).with_suffix("").parts  # ("deepspeed", "utils", "__init__")
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(part.startswith("_") for part in parts):
            paths.add(".".join(parts))
    return frozenset(paths)


@functools.cache
def _reexporters() -> dict[str, tuple[str, ...]]:
    """For a DeepSpeed class or function (by where DeepSpeed defines it), the full names under which the
    modules zero has a file for re-export it."""
    index: dict[str, list[str]] = {}
    for path in sorted(_own_paths() & _blocks().keys()):
        for name, listed in module_names(path).items():
            if listed.kind in ("class", "function") and listed.value is not None:
                index.setdefault(listed.value, []).append(f"{path}.{name}")
    return {home: tuple(names) for home, names in index.items()}


class NotAvailableError(NotImplementedError):
    """A DeepSpeed name zero lacks was used (see [Note: absent names])."""


class _AbsentAttribute(NotAvailableError, AttributeError):
    """An attribute of a stand-in was read: also an AttributeError, so hasattr(), inspect and
    mock.create_autospec see a missing attribute."""


class _StandIn(type):
    """The metaclass of stand-ins: calling one or reading its attributes raises."""

    def __call__(cls, *args, **kwargs):
        raise NotAvailableError(cls._message)

    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise _AbsentAttribute(cls._message)

    def __repr__(cls) -> str:
        return f"<{cls._full}: not available in zero>"


@functools.cache
def stand_in(full: str, reason: str) -> type:
    """A class standing for the DeepSpeed name `full` (see [Note: absent names])."""
    message = f"{full} is not available in zero: {reason}"
    return _StandIn(full.rsplit(".", 1)[-1], (), {"_full": full, "_message": message, "__module__": "zero.deepspeed"})


def _nearest_package(full: str) -> str | None:
    parts = full.split(".")
    return next((ABSENT_PACKAGES[p] for p in (".".join(parts[:n]) for n in range(len(parts), 0, -1))
                 if p in ABSENT_PACKAGES), None)


def _absent_feature(full: str) -> str | None:
    """The reason a DeepSpeed module zero has no file for lies in a package of a feature zero lacks
    (see [Note: the feature table] in zero/features.py), or None."""
    parts = full.split(".")
    package = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in ABSENT_PACKAGES),
                   None)
    if package is None:
        return None
    # a module of a name with a reason of its own (an older DeepSpeed's OnebitAdam) says that one
    return next((r for name, r in ABSENT_NAMES.items() if name.rpartition(".")[0] == full), ABSENT_PACKAGES[package])


def _reason(*names: str | None) -> str:
    """Why a DeepSpeed name is absent: the entry of the first of `names` (the name as used, its listed
    path, where DeepSpeed defines it) that has one, else the nearest absent package of one of them."""
    names = tuple(n for n in names if n)
    return (next((ABSENT_NAMES[n] for n in names if n in ABSENT_NAMES), None)
            or next((r for r in map(_nearest_package, names) if r is not None), None) or GENERAL_REASON)


def _canonical(module: str) -> str:
    """The listed path of the DeepSpeed module `module`: itself, or the module its parent binds under
    that name (`deepspeed.checkpointing` is deepspeed.runtime.activation_checkpointing.checkpointing)."""
    if module in _blocks() or "." not in module:
        return module
    parent, _, name = module.rpartition(".")
    listed = module_names(_canonical(parent)).get(name)
    return listed.value if listed is not None and listed.kind == "module" else module


_seeking = threading.local()  # .homes: the definitions _zeros_own is looking for (a re-export cycle ends there)


def _zeros_own(home: str):
    """zero's own object for the DeepSpeed class or function defined at `home` (`deepspeed.a.b.Name`):
    what zero's file for deepspeed.a.b, or for a module that re-exports it, has under that name; None
    if zero has none."""
    seeking = _seeking.__dict__.setdefault("homes", set())
    if home in seeking:
        return None
    seeking.add(home)
    try:
        for full in (home, *_reexporters().get(home, ())):
            module, _, name = full.rpartition(".")
            if module not in _own_paths():
                continue
            found = getattr(importlib.import_module(f"zero.{module}"), name, None)
            if found is not None and not isinstance(found, (_StandIn, types.ModuleType)):
                return found
        return None
    finally:
        seeking.discard(home)


def missing(module: str, name: str):
    """Module `__getattr__` of the compatibility layer: `module.name` that zero's file does not define.

    Args:
        module: the DeepSpeed name of the module or its zero name (`zero.deepspeed.utils`).
        name: the attribute asked for.

    Returns what [Note: the name list] says for a listed name (or a submodule); raises AttributeError
    for any other name.
    """
    here = module.removeprefix("zero.")
    path = _canonical(here)
    if name == "__path__" and path in _packages():
        return []  # zero's file for a DeepSpeed package: _AbsentPackages imports its other modules
    if name.startswith("__"):
        raise AttributeError(name)
    full, listed_full = f"{here}.{name}", f"{path}.{name}"
    listed = module_names(path).get(name)
    if listed is None:
        if listed_full in _module_paths() or f"{here}.{name}" in _own_paths():  # a submodule not imported yet
            try:
                return importlib.import_module(f"zero.{listed_full if listed_full in _module_paths() else full}")
            except ImportError as exc:  # a feature zero lacks: an attribute that is not there (hasattr)
                raise AttributeError(str(exc)) from None
        if listed_full in ABSENT_NAMES:  # a name of an older DeepSpeed
            return stand_in(full, ABSENT_NAMES[listed_full])
        raise AttributeError(f"{full} is not part of zero's DeepSpeed compatibility layer (see "
                             f"docs/migrating-from-deepspeed.md for what is)")
    if listed.kind == "constant":
        return listed.value
    if listed.kind == "module":
        try:
            return importlib.import_module(f"zero.{listed.value}")
        except ImportError as exc:  # a feature zero lacks (see _absent_feature)
            raise AttributeError(str(exc)) from None
    if listed.kind == "logger":
        return logging.getLogger("zero")  # deepspeed.utils.logger
    if listed.kind in ("class", "function"):
        own = _zeros_own(listed.value or listed_full)
        if own is not None:
            return own
    return stand_in(full, _reason(full, listed_full, listed.value))


class _AbsentModule(types.ModuleType):
    """A DeepSpeed module zero has no file for: `missing` answers for its names."""

    def __getattr__(self, name: str):
        return missing(self.__name__, name)

    def __dir__(self):
        return sorted({*module_names(self.__name__.removeprefix("zero.")), *vars(self)})

    def __setattr__(self, name: str, value) -> None:
        # Importing a submodule binds it on its parent. Where DeepSpeed's parent binds that name to
        # something else (deepspeed.compile.custom_ops.all_to_all, a function), DeepSpeed's stays.
        listed = module_names(self.__name__.removeprefix("zero.")).get(name)
        if isinstance(value, types.ModuleType) and listed is not None and (
                listed.kind != "module" or value.__name__ != f"zero.{listed.value}"):
            return
        super().__setattr__(name, value)


class _AbsentPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `zero.deepspeed.<a DeepSpeed module zero has no file for>` as an _AbsentModule.

    It runs before the path finder, which would otherwise follow a `__path__` that a module's
    `__getattr__` answers for (zero.deepspeed.comm forwards to torch.distributed) into another
    package's files: a module under such a path that is not DeepSpeed's is not found."""

    def find_spec(self, fullname, path, target=None):
        full = fullname.removeprefix("zero.")
        if not fullname.startswith("zero.deepspeed.") or full in _own_paths():
            return None
        reason = _absent_feature(full)
        if reason is not None:  # a part of DeepSpeed zero does not implement at all: import probes see it missing
            raise ImportError(f"{full} is not available in zero: {reason}", name=fullname)
        if full in _module_paths():
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        if path and not all(Path(p).resolve().is_relative_to(_HERE) for p in path):
            raise ModuleNotFoundError(f"No module named {fullname!r} (not a DeepSpeed module)", name=fullname)
        return None

    def create_module(self, spec):
        return _AbsentModule(spec.name)

    def exec_module(self, module) -> None:
        full = module.__name__.removeprefix("zero.")
        module.__doc__ = f"{full}: not available in zero ({_reason(full)})"


if not any(isinstance(f, _AbsentPackages) for f in sys.meta_path):  # once, before the path finder
    sys.meta_path.insert(0, _AbsentPackages())
