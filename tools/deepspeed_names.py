"""Write the list of DeepSpeed's public names that zero.deepspeed answers for.

Run it where DeepSpeed is installed (a development machine; zero never depends on DeepSpeed):

    DS_ACCELERATOR=cpu python tools/deepspeed_names.py

It imports every module of the installed `deepspeed` package and writes two generated files:

- zero/deepspeed/public_names.txt: each module path at column 0, then its public names indented,
  one per line with its kind: `name class`, `name function` (either followed by the path where
  DeepSpeed defines it, when the module re-exports it), `name module <path>` (another DeepSpeed
  module bound under this name, as `deepspeed.zero`), `name logger` (a logging.Logger), `name
  value` (any other object), or `name = <repr>` (a literal constant, with its value).
- zero/deepspeed/engine_members.txt: the public members of deepspeed.runtime.engine.DeepSpeedEngine
  that torch.nn.Module lacks, as `name method|property|classmethod|staticmethod|value`.

A public name of a module is what `dir(module)` shows, less names starting with `_`, submodules
(listed as module paths of their own), classes and functions defined outside DeepSpeed (torch,
typing and the standard library re-exported), typing constructs (`Optional`, TypeVars) and
`__future__` features. A constant that names a file of this machine is a `value`. A module that does
not import here (it needs triton, a GPU or a process group) is read from its source with `ast`: its
top-level classes, functions and assignments. zero/deepspeed/_missing.py reads both files (see
[Note: the name list] there); tests/test_deepspeed_names.py checks zero.deepspeed against them.
"""
from __future__ import annotations
import __future__

import ast
import importlib
import inspect
import logging
import os
import pkgutil
import sys
import types
import warnings
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "zero" / "deepspeed"
COMMAND = "DS_ACCELERATOR=cpu python tools/deepspeed_names.py"
LITERAL_TYPES = (str, int, float, bool, type(None))
# a constant naming a file of this machine (a template inside the installed DeepSpeed) is a `value`
MACHINE_PATHS = (sys.prefix, sys.base_prefix, str(Path.home()))


def is_literal(value: object) -> bool:
    """A constant that `ast.literal_eval(repr(value))` gives back: str/int/float/bool/None, and
    tuples, lists and dicts of those."""
    def plain(v):
        if type(v) in LITERAL_TYPES:
            return True
        if type(v) in (tuple, list):
            return all(plain(x) for x in v)
        if type(v) is dict:
            return all(plain(k) and plain(x) for k, x in v.items())
        return False

    if not plain(value):
        return False
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False  # inf, nan


def in_deepspeed(module_name: str | None) -> bool:
    return module_name is not None and (module_name == "deepspeed" or module_name.startswith("deepspeed."))


def is_private(path: str) -> bool:
    return any(part.startswith("_") for part in path.split("."))


def module_paths() -> list[str]:
    """Every public module path of the installed DeepSpeed, those inside a package that does not
    import here included (pkgutil cannot walk into it: its directory is read instead)."""
    import deepspeed

    def files(directory: Path, prefix: str):
        for found in pkgutil.iter_modules([str(directory)], prefix):
            yield found.name
            if found.ispkg:
                yield from files(directory / found.name.rsplit(".", 1)[1], found.name + ".")

    broken: list[str] = []
    paths = [m.name for m in pkgutil.walk_packages(deepspeed.__path__, "deepspeed.", onerror=broken.append)]
    root = Path(deepspeed.__file__).parent
    for package in broken:
        paths.extend(files(root.joinpath(*package.split(".")[1:]), package + "."))
    return sorted({"deepspeed", *(p for p in paths if not is_private(p))})


def source_file(path: str) -> Path:
    import deepspeed

    base = Path(deepspeed.__file__).parent.joinpath(*path.split(".")[1:])
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def names_of_module(module: types.ModuleType, walked: set[str]) -> dict[str, str]:
    """The public names of an imported module: name -> its line's tail (`class`, `= 3`, ...)."""
    names = {}
    for name in dir(module):
        if name.startswith("_"):
            continue
        try:
            value = getattr(module, name)
        except Exception:  # a lazy attribute that fails here
            names[name] = "value"
            continue
        if isinstance(value, types.ModuleType):
            target = value.__name__
            if in_deepspeed(target) and target != f"{module.__name__}.{name}" and target in walked:
                names[name] = f"module {target}"  # bound under another name (deepspeed.zero)
            continue  # a submodule is a module path of its own; torch, os, ... are not DeepSpeed's
        if isinstance(value, __future__._Feature) or type(value).__module__ in ("typing", "typing_extensions"):
            continue  # `annotations`; Optional, List, TypeVars
        if inspect.isclass(value) or inspect.isroutine(value):
            home = getattr(value, "__module__", None)
            if not in_deepspeed(home):
                continue  # re-exported from torch, typing or the standard library
            names[name] = "class" if inspect.isclass(value) else "function"
            qualname = getattr(value, "__qualname__", "")
            if (home, qualname) != (module.__name__, name) and home in walked and "." not in qualname and \
                    getattr(sys.modules.get(home), qualname, None) is value:
                names[name] += f" {home}.{qualname}"  # re-exported: where DeepSpeed defines it
        elif isinstance(value, logging.Logger):
            names[name] = "logger"
        elif is_literal(value) and not any(place in repr(value) for place in MACHINE_PATHS):
            names[name] = f"= {value!r}"
        else:
            names[name] = "value"
    return names


def names_from_source(path: Path) -> dict[str, str]:
    """The public top-level definitions of a module that does not import here, read with `ast`."""
    names: dict[str, str] = {}

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = "function"
            elif isinstance(node, ast.ClassDef):
                names[node.name] = "class"
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                try:
                    tail = f"= {ast.literal_eval(node.value)!r}"
                except (ValueError, SyntaxError, TypeError):
                    tail = "value"
                for target in targets:
                    if isinstance(target, ast.Name):
                        names[target.id] = tail
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)

    visit(ast.parse(path.read_text(), str(path)).body)
    return {n: t for n, t in names.items() if not n.startswith("_")}


def engine_members() -> dict[str, str]:
    """The public members of DeepSpeedEngine that torch.nn.Module lacks, with their kind."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    kinds = {}
    for name in sorted(set(dir(DeepSpeedEngine)) - set(dir(torch.nn.Module))):
        if name.startswith("_"):
            continue
        member = inspect.getattr_static(DeepSpeedEngine, name)
        for kind, test in (("property", property), ("classmethod", classmethod), ("staticmethod", staticmethod)):
            if isinstance(member, test):
                kinds[name] = kind
                break
        else:
            kinds[name] = "method" if inspect.isfunction(member) else "value"
    return kinds


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    import deepspeed
    import torch

    paths = module_paths()
    walked = set(paths)
    listed: dict[str, dict[str, str]] = {}
    from_source = []
    for path in paths:
        try:
            module = importlib.import_module(path)
        except BaseException as exc:  # noqa: B036 - a module may raise SystemExit or assert at import
            from_source.append(f"{path} ({type(exc).__name__}: {str(exc)[:80]})")
            listed[path] = names_from_source(source_file(path))
        else:
            listed[path] = names_of_module(module, walked)

    header = (f"# Generated by `{COMMAND}` from DeepSpeed {deepspeed.__version__} (torch {torch.__version__}): "
              f"do not edit.\n")
    lines = [header, "# A module path at column 0, then its public names: `name class [defined at]`, "
                     "`name function [defined at]`, `name module <path>`, `name logger`, `name value`, "
                     "or `name = <literal value>`.\n"]
    for path in paths:
        lines.append(f"{path}\n")
        lines.extend(f"    {name} {tail}\n" for name, tail in sorted(listed[path].items()))
    (OUT / "public_names.txt").write_text("".join(lines))

    members = engine_members()
    (OUT / "engine_members.txt").write_text(
        header + "# The public members of deepspeed.runtime.engine.DeepSpeedEngine that torch.nn.Module lacks: "
                 "`name kind`.\n" + "".join(f"{name} {kind}\n" for name, kind in members.items()))

    count = sum(len(n) for n in listed.values())
    print(f"{len(paths)} modules, {count} names, {len(members)} engine members; read from source:",
          *from_source, sep="\n  ", file=sys.stderr)


if __name__ == "__main__":
    main()
