"""Config errors and warnings, and pydantic's errors turned into messages that name the key.

A misspelt key becomes "unknown key 'x'; did you mean 'y'?" with its full dotted path; a bad value
names its path and the expected type or range. `ConfigError.issues` keeps every (path, message).
"""
from __future__ import annotations

import difflib
import typing
import warnings
from typing import Any, Optional

from pydantic import BaseModel, ValidationError


class DeepSpeedConfigError(Exception):
    """DeepSpeed's config error (`deepspeed.DeepSpeedConfigError`): every `ConfigError` is one, so a
    script's `except deepspeed.DeepSpeedConfigError` catches zero's config errors."""


class ConfigError(DeepSpeedConfigError, ValueError):
    """A config that cannot be used: unknown key, bad value, or unsupported feature.

    `issues` holds (key path, message) pairs; `str(err)` lists them all.
    """

    def __init__(self, message: str, issues: Optional[list[tuple[str, str]]] = None):
        super().__init__(message)
        self.issues = issues or []


class ConfigWarning(UserWarning):
    """A config key that is accepted but has no effect in `zero` (logging, profiling, deprecated)."""


def _warn(msg: str) -> None:
    warnings.warn(msg, ConfigWarning, stacklevel=4)


class _NestedIssues(ValueError):
    """Raised inside a validator to report issues at paths relative to the validated value."""

    def __init__(self, issues: list[tuple[tuple, str]]):
        super().__init__("; ".join(m for _, m in issues))
        self.issues = issues


def _keys_of(cls: type) -> set[str]:
    keys = set()
    for name, field in getattr(cls, "model_fields", {}).items():
        keys.add(name)
        if field.alias:
            keys.add(field.alias)
    return keys


def _submodel(annotation: Any) -> Optional[type]:
    """The _Section class inside Optional[X] / X, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _model_at(root: type, loc: tuple) -> Optional[type]:
    cls = root
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = None
        for name, f in cls.model_fields.items():
            if part in (name, f.alias):
                field = f
                break
        if field is None:
            return None
        cls = _submodel(field.annotation)
    return cls


def _all_paths(cls: type, prefix: str = "") -> dict[str, str]:
    """Leaf key name -> full dotted path, for "did you mean section.key" hints."""
    out: dict[str, str] = {}
    for name, field in cls.model_fields.items():
        key = field.alias or name
        sub = _submodel(field.annotation)
        if sub is not None:
            out.update({k: v for k, v in _all_paths(sub, f"{prefix}{key}.").items() if k not in out})
        out.setdefault(key, f"{prefix}{key}")
    return out


def _suggest(bad: str, valid: set[str], root: Optional[type] = None, nested: bool = False) -> str:
    close = difflib.get_close_matches(bad, sorted(valid), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    if root is not None:
        path = _all_paths(root).get(bad)
        if path and "." in path:
            return f"; did you mean '{path}'?"
        if path and nested:  # a top-level section put inside another one
            return f"; '{path}' is a section at the top level of the config"
    return ""


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _issues_from(err: ValidationError, root: type, prefix: tuple = ()) -> list[tuple[tuple, str]]:
    """Turn pydantic's errors into (path, readable message) pairs."""
    issues: list[tuple[tuple, str]] = []
    for e in err.errors(include_url=False):
        loc = prefix + tuple(e["loc"])
        kind = e["type"]
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _NestedIssues):
            issues.extend((loc + sub, msg) for sub, msg in ctx_err.issues)
            continue
        if kind == "extra_forbidden":
            bad = str(e["loc"][-1])
            valid = _keys_of(_model_at(root, tuple(e["loc"][:-1])) or object)
            issues.append((loc, f"unknown key '{bad}'{_suggest(bad, valid, root, nested=len(loc) > 1)}"))
            continue
        if kind == "missing":
            issues.append((loc, "required key is missing (or was \"auto\" with no value supplied)"))
            continue
        msg = e["msg"]
        for head in ("Value error, ", "Assertion failed, "):
            if msg.startswith(head):
                msg = msg[len(head):]
        msg = msg.replace("Input should be", "expected")
        for words, sign in (("greater than or equal to", ">="), ("less than or equal to", "<="),
                            ("greater than", ">"), ("less than", "<")):
            msg = msg.replace(f"expected {words} ", f"expected a value {sign} ")
        if kind in ("int_from_float", "int_parsing", "int_type"):
            msg = "expected an integer"
        if kind == "int_parsing_size":
            msg = "expected an integer that fits in 64 bits"
        if kind != "value_error":
            msg += f", got {_fmt(e.get('input'))}"
        issues.append((loc, msg))
    return issues


def _path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "<config>"


def _raise(issues: list[tuple[tuple, str]], source: str = "") -> typing.NoReturn:
    flat = [(_path(loc), msg) for loc, msg in issues]
    where = f" in {source}" if source else ""
    if len(flat) == 1:
        raise ConfigError(f"invalid config{where}: {flat[0][0]}: {flat[0][1]}", flat)
    lines = "\n".join(f"  - {p}: {m}" for p, m in flat)
    raise ConfigError(f"invalid config{where} ({len(flat)} problems):\n{lines}", flat)


def _validate_nested(model: type, value: Any) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise _NestedIssues(_issues_from(err, model)) from None
