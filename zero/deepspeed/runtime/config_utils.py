"""`deepspeed.runtime.config_utils`: the base of DeepSpeed's pydantic config models and the small
helpers its config code reads JSON with.

`DeepSpeedConfigModel` is what DeepSpeed's (and third-party) config sections derive from: a pydantic
model that forbids unknown keys, validates on assignment, drops "auto" values (so the default
applies) and knows *deprecated fields*: a field declared with

    old: int = Field(0, json_schema_extra={"deprecated": True, "new_param": "new"})

warns when a config sets it and, when it names a `new_param`, moves its value (through
`new_param_fn` if given) to that field, which may be nested (`"offload.device"`), and removes the
old one. zero's own config (zero.config.ZeroConfig) is a separate, stricter model of the same JSON;
this module is for code written against DeepSpeed's classes.
"""
from __future__ import annotations

import collections.abc
import json
import logging
from functools import reduce
from typing import Any

from pydantic import BaseModel, ConfigDict, field_serializer

from zero.deepspeed._missing import missing

logger = logging.getLogger("zero.deepspeed")

AUTO = "auto"


class DeepSpeedConfigModel(BaseModel):
    """A DeepSpeed config section: pydantic, unknown keys forbidden, deprecated fields handled.

    Args:
        strict: keep "auto" values (and let validation reject them); by default a key whose value is
            the string "auto" is dropped so its default applies, as DeepSpeed does for Hugging Face
            configs (the key `replace_method` keeps its "auto").
        **data: the section's keys.

    A field is deprecated when its `json_schema_extra` holds `"deprecated": True`; further keys there:
    `deprecated_msg` (added to the warning), `new_param` (the field, dotted for a nested one, that
    replaces it), `set_new_param` (default True: copy the value over) and `new_param_fn` (converts
    the old value for the new field). Giving both a deprecated field and its replacement is an error.
    """

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {k: v for k, v in data.items() if k == "replace_method" or not (isinstance(v, str) and v == AUTO)}
        super().__init__(**data)
        self._deprecated_fields_check()

    def _deprecated_fields_check(self) -> None:
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False):
                self._process_deprecated_field(name)

    def _process_deprecated_field(self, dep_field: str) -> None:
        """Warn about a deprecated field the config set and move its value to its replacement."""
        if dep_field not in self.model_fields_set:
            return
        extra = type(self).model_fields[dep_field].json_schema_extra
        new_field = extra.get("new_param", "")
        note = extra.get("deprecated_msg", "")
        logger.warning("Config parameter %s is deprecated%s%s", dep_field,
                       f" use {new_field} instead" if new_field else "", f". {note}" if note else "")
        if not new_field or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda x: x)(getattr(self, dep_field))
        delattr(self, dep_field)
        *parents, leaf = new_field.split(".")
        owner = reduce(getattr, parents, self)
        if leaf in owner.model_fields_set:
            raise ValueError(f"config parameter '{dep_field}' is deprecated and replaced by '{new_field}'; "
                             f"give only '{new_field}'")
        setattr(owner, leaf, value)

    @field_serializer("dtype", check_fields=False)
    def serialize_torch_dtype(dtype: Any) -> str:  # noqa: N805 (pydantic passes the value alone)
        return str(dtype)


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    """The default of `field_name` in a config model (class or instance).

    Raises:
        ValueError: the model has no such field, or the field is required (it has no default).
    """
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    if field_name not in fields:
        raise ValueError(f"'{field_name}' is not a field of {getattr(config, '__name__', type(config).__name__)}")
    if fields[field_name].is_required():
        raise ValueError(f"'{field_name}' is a required field and has no default value")
    return fields[field_name].get_default(call_default_factory=True)


class pp_int(int):  # noqa: N801 (DeepSpeed's name)
    """An int that prints with thousands separators (`repr(pp_int(10**5)) == "100,000"`), or as a
    given string: for defaults shown in generated documentation.

    Args:
        val: the value (anything `int()` takes).
        custom_print_str: what `repr` shows instead, if given.
    """

    def __new__(cls, val: Any, custom_print_str: str | None = None) -> pp_int:
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str or f"{int(self):,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """`json.dumps(obj, cls=ScientificNotationEncoder)`: numbers above 1e3 written as `1.000000e+04`,
    everything else as usual, mappings one key per line (indented by `indent`, default 4). Used to
    print configs readably; bool stays true/false."""

    def iterencode(self, o: Any, _one_shot: bool = False) -> list[str]:
        return [self._encode(o, 0)]

    def _encode(self, o: Any, level: int) -> str:
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, (int, float)):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, collections.abc.Mapping):
            step = " " * (self.indent if isinstance(self.indent, int) else 4)
            items = [f"\n{step * (level + 1)}{json.dumps(str(k))}: {self._encode(v, level + 1)}" for k, v in o.items()]
            return "{" + ",".join(items) + f"\n{step * level}}}"
        if isinstance(o, collections.abc.Sequence) and not isinstance(o, str):
            return "[" + ", ".join(self._encode(v, level) for v in o) + "]"
        return "".join(super().iterencode(o, _one_shot=False))


class DeepSpeedConfigObject:
    """A plain config object whose repr is its attributes as JSON (see ScientificNotationEncoder)."""

    def repr(self) -> dict:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def get_scalar_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    """`param_dict[param_name]`, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    """`param_dict[param_name]`, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    """`param_dict[param_name]`, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict:
    """`json.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)`: a JSON object that names
    a key twice is a ValueError naming the keys, not a silent last-one-wins."""
    counts = collections.Counter(key for key, _ in ordered_pairs)
    repeated = [key for key, n in counts.items() if n > 1]
    if repeated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {repeated}")
    return dict(ordered_pairs)


def __getattr__(name: str):
    return missing(__name__, name)
