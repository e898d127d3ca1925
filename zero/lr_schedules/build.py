"""`build_scheduler`: a config's ``{"type": ..., "params": {...}}`` block -> a scheduler.

DeepSpeed's schedules come first, then any `torch.optim.lr_scheduler` class JSON can configure.
Type names, parameter names, missing parameters and value types are checked against the
constructor's signature before anything is built.
"""

from __future__ import annotations

import ast
import difflib
import inspect
from typing import Any

from zero.lr_schedules.checks import is_int, is_number, torch_optimizer
from zero.lr_schedules.schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

DEEPSPEED_SCHEDULERS: dict[str, type] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}

# torch schedulers whose required arguments are Python callables or other scheduler objects.
_TORCH_NOT_FROM_JSON = {
    "LambdaLR": "lr_lambda is a Python function",
    "MultiplicativeLR": "lr_lambda is a Python function",
    "SequentialLR": "schedulers are scheduler objects",
    "ChainedScheduler": "schedulers are scheduler objects",
}


def _torch_scheduler_classes() -> dict[str, type]:
    """Every public scheduler class in torch.optim.lr_scheduler, by name."""
    import torch.optim.lr_scheduler as torch_sched

    base = getattr(torch_sched, "LRScheduler", torch_sched._LRScheduler)
    found = {}
    for name in dir(torch_sched):
        obj = getattr(torch_sched, name)
        if name.startswith("_") or not isinstance(obj, type) or name == "LRScheduler":
            continue
        if issubclass(obj, base) or name == "ReduceLROnPlateau":
            found[name] = obj
    return found


def valid_scheduler_names() -> list[str]:
    """The names `build_scheduler` accepts: DeepSpeed's, then torch's that JSON can configure."""
    torch_names = sorted(n for n in _torch_scheduler_classes() if n not in _TORCH_NOT_FROM_JSON)
    return list(DEEPSPEED_SCHEDULERS) + torch_names


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split ``text`` on ``sep`` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _matches_annotation(value: Any, ann: Any) -> bool | None:
    """Whether a JSON value fits a (string) annotation; None when the annotation is not understood."""
    if ann is inspect.Parameter.empty:
        return None
    if not isinstance(ann, str):
        ann = getattr(ann, "__name__", None) or str(ann)
    ann = ann.strip().replace("typing.", "")
    for wrapper in ("Optional[", "Union["):
        if ann.startswith(wrapper) and ann.endswith("]"):
            inner = _split_top_level(ann[len(wrapper):-1], ",")
            ann = " | ".join(inner + (["None"] if wrapper == "Optional[" else []))
    alternatives = _split_top_level(ann, "|")
    if len(alternatives) > 1:
        results = [_matches_annotation(value, alt) for alt in alternatives]
        if any(r is True for r in results):
            return True
        return None if any(r is None for r in results) else False

    simple = {
        "None": lambda v: v is None,
        "int": is_int,
        "float": is_number,
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
    }
    if ann in simple:
        return simple[ann](value)
    if ann.startswith("Literal[") and ann.endswith("]"):
        try:
            choices = ast.literal_eval("(" + ann[len("Literal["):-1] + ",)")
        except (ValueError, SyntaxError):
            return None
        return value in choices
    for seq in ("list[", "List[", "Sequence[", "Iterable[", "tuple[", "Tuple["):
        if ann.startswith(seq) and ann.endswith("]"):
            if not isinstance(value, (list, tuple)):
                return False
            item_ann = _split_top_level(ann[len(seq):-1], ",")[0]
            results = [_matches_annotation(item, item_ann) for item in value]
            if any(r is False for r in results):
                return False
            return True if all(r is True for r in results) else None
    return None


def _check_params(type_name: str, cls: type, params: dict[str, Any]) -> None:
    """Reject unknown, missing and mistyped keyword arguments before anything is built."""
    signature = inspect.signature(cls.__init__)
    accepted = {name: p for name, p in list(signature.parameters.items())[1:]
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "optimizer"}
    for key in params:
        if key == "optimizer":
            raise ValueError(f"{type_name}: 'optimizer' cannot be set in params; it is passed separately")
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{type_name} has no parameter {key!r}{hint} "
                             f"Its parameters are: {', '.join(accepted)}")
    missing = [name for name, p in accepted.items()
               if p.default is inspect.Parameter.empty and name not in params]
    if missing:
        raise ValueError(f"{type_name}: missing required parameter(s) {', '.join(map(repr, missing))}")
    mistyped = mistyped_params(cls, params)
    if mistyped:
        key, ann = next(iter(mistyped.items()))
        raise ValueError(f"{type_name}: parameter {key!r} must be {ann}, "
                         f"got {type(params[key]).__name__} {params[key]!r}")


def mistyped_params(cls: type, params: dict[str, Any]) -> dict[str, str]:
    """The keyword arguments whose JSON value does not fit the annotation of ``cls.__init__``.

    Args:
        cls: a scheduler class.
        params: keyword arguments; names ``cls`` does not accept are skipped.

    Returns:
        parameter name -> its annotation as written, for each value that is certainly of the wrong
        type (a string where a number is expected, a boolean where an int is, ...). Annotations the
        checker does not understand are given the benefit of the doubt.
    """
    signature = inspect.signature(cls.__init__)
    out = {}
    for key, value in params.items():
        p = signature.parameters.get(key)
        if p is not None and _matches_annotation(value, p.annotation) is False:
            ann = p.annotation
            out[key] = ann if isinstance(ann, str) else getattr(ann, "__name__", None) or str(ann)
    return out


def build_scheduler(type_name: str, params: dict[str, Any] | None, optimizer: Any) -> Any:
    """Build the scheduler a config's ``{"type": ..., "params": {...}}`` block describes.

    DeepSpeed's schedulers are looked up first, then `torch.optim.lr_scheduler`, as DeepSpeed
    does; ``params`` become keyword arguments. Everything is checked before the optimizer's lr
    is written, and a failed torch constructor leaves the param groups as they were.

    Args:
        type_name: a DeepSpeed scheduler name ("WarmupLR", ...) or a torch scheduler class name
            ("StepLR", "CosineAnnealingLR", ...).
        params: keyword arguments for the scheduler (not including the optimizer); None means {}.
        optimizer: the optimizer to schedule.

    Returns:
        The scheduler instance.

    Raises:
        ValueError: unknown name (with the closest valid one), a torch scheduler that needs
            Python objects, or an unknown, missing, mistyped or out-of-range parameter.
    """
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"{type_name}: scheduler params must be a dict, got {type(params).__name__}")
    if type_name in _TORCH_NOT_FROM_JSON:
        raise ValueError(
            f"scheduler type {type_name!r} cannot be built from a config ({_TORCH_NOT_FROM_JSON[type_name]}); "
            f"construct torch.optim.lr_scheduler.{type_name} in Python and pass the object as lr_scheduler"
        )
    torch_classes = _torch_scheduler_classes()
    cls = DEEPSPEED_SCHEDULERS.get(type_name) or torch_classes.get(type_name)
    if cls is None:
        valid = valid_scheduler_names()
        close = difflib.get_close_matches(str(type_name), valid, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown scheduler type {type_name!r}.{hint} Valid types: {', '.join(valid)}")

    _check_params(type_name, cls, params)
    if cls in DEEPSPEED_SCHEDULERS.values():
        return cls(optimizer, **params)  # validates every value before writing the optimizer

    # torch schedulers write initial_lr/lr as they construct; undo that if they then fail.
    groups = torch_optimizer(optimizer, type_name).param_groups
    saved = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError, ZeroDivisionError) as err:
        for group, before in zip(groups, saved):
            for key in [k for k in group if k != "params" and k not in before]:
                del group[key]
            group.update(before)
        raise ValueError(f"{type_name}: invalid params {params!r}: {err}") from err
