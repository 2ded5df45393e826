"""TOML experiment configs: the file layout and checks shared by ``dqsgd compare`` and ``dqsgd dq run``.

A config file has plain tables (``[train]``; ``[experiment]``, ``[problem]``, ``[run]``) and one
``[methods.LABEL]`` table per method, in file order. A :class:`ConfigSchema` names the plain tables
and the error type of one kind of config, and does what both kinds need:

* :meth:`~ConfigSchema.load_raw`: a shipped config by name (``experiments/configs/*.toml``) or a
  TOML file by path, as a dict;
* :meth:`~ConfigSchema.apply_overrides`: ``section.key=value`` and ``methods.LABEL.key=value``
  strings, the value read as TOML (a bare word is a string);
* :meth:`~ConfigSchema.check_sections`: only the named tables, each a table;
* :meth:`~ConfigSchema.fields`: a table's values checked against a frozen dataclass's fields and
  coerced to their types (:func:`coerce`);
* :meth:`~ConfigSchema.methods`: the ``[methods.LABEL]`` tables in file order.

Every refusal is raised as the schema's error type (a :class:`ConfigError`) with a message that
names the key and what is allowed. This module imports nothing heavy: ``dqsgd --help`` and
``dqsgd configs`` read configs without torch.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "ConfigSchema", "check_name", "coerce", "shipped_configs", "load_raw", "apply_overrides",
           "parse_toml"]

SHIPPED_PACKAGE = "dqsgd.experiments"  # the shipped configs are this package's configs/*.toml


class ConfigError(ValueError):
    """A configuration that cannot be run: says which key and what is allowed."""


# A name that becomes one path component (train.name, experiment.name, a method label): no
# separator, never "." or "..", nothing a shell or a file system treats specially.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,127}")


def check_name(where: str, value: Any, error: type[ValueError] = ConfigError) -> str:
    """``value`` if it can be a directory name, else ``error`` naming ``where``: 1-128 characters
    of letters, digits and ``. _ - + = @``, not starting with ``.``, ``-``, ``+``, ``=`` or ``@``
    (so no ``/``, no ``..``, no empty or hidden name)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise error(f"{where} = {value!r} cannot name a directory: use 1-128 letters, digits and . _ - + = @, "
                    f"starting with a letter, digit or _ (no '/', no '..')")
    return value


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def coerce(where: str, value: Any, default: Any, item: type | None = None,
           error: type[ValueError] = ConfigError) -> Any:
    """``value`` as the type of ``default`` (``where`` names the key in errors, e.g. ``train.lr``).

    An int stands for a float; a float must be finite; a list stands for a tuple, whose items are
    of type ``item`` (int or float: "a list of integers" or "a list of numbers", ints read as
    floats). Any other value must be of ``default``'s type exactly (a bool is not an int).
    """
    if isinstance(default, tuple):
        item = item or (type(default[0]) if default else float)
        ok = isinstance(value, (list, tuple)) and all(
            _is_number(v) and (item is float or isinstance(v, int)) and math.isfinite(v) for v in value)
        if not ok:
            kind = "integers" if item is int else "numbers"
            raise error(f"{where} must be a list of {kind}, got {value!r}")
        return tuple(item(v) for v in value)
    if isinstance(default, float) and _is_number(value):
        if not math.isfinite(value):
            raise error(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if type(value) is not type(default):
        raise error(f"{where} must be {type(default).__name__}, got {value!r}")
    return value


def _default(f: dataclasses.Field) -> Any:
    """A field's default value (every field a config table sets has one)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _tuple_items(cls: type) -> dict[str, type]:
    """The item type of each ``tuple[T, ...]`` field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is tuple else ()
        if args:
            out[f.name] = args[0]
    return out


def _union_types(cls: type) -> dict[str, tuple[type, ...]]:
    """The member types of each ``A | B`` field of dataclass ``cls`` (None excluded)."""
    hints = typing.get_type_hints(cls)
    return {f.name: tuple(t for t in typing.get_args(hints[f.name]) if t is not type(None))
            for f in dataclasses.fields(cls) if isinstance(hints[f.name], types.UnionType)}


def shipped_configs(prefix: str = "") -> dict[str, Path]:
    """Shipped config files by name (optionally only those whose name starts with ``prefix``)."""
    folder = resources.files(SHIPPED_PACKAGE) / "configs"
    return {p.name[:-5]: Path(str(p)) for p in folder.iterdir() if p.name.startswith(prefix) and p.name.endswith(".toml")}


def load_raw(name_or_path: str, prefix: str = "", error: type[ValueError] = ConfigError) -> tuple[dict[str, Any], str]:
    """A shipped config by name, or a TOML file by path, as a raw dict (and the path it came from)."""
    shipped = shipped_configs(prefix)
    path = shipped.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise error(f"no config {name_or_path!r}: not a file, and the shipped configs are {', '.join(sorted(shipped))}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read it ({e})") from None
    return parse_toml(text, str(path), error), str(path)


def parse_toml(text: str, where: str, error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """TOML ``text`` as a dict; malformed, or nested too deep to read (a ``RecursionError`` in the
    parser): ``error`` naming ``where``."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{where}: malformed TOML: {e}") from None
    except RecursionError:
        raise error(f"{where}: arrays or tables nested too deep to read") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str], sections: tuple[str, ...],
                    error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """``section.key=value`` (TOML value; bare words are strings) applied to a copy of a raw config dict.

    ``sections`` are the plain tables a config has; ``methods.LABEL.KEY=VALUE`` is always accepted.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    methods = raw.get("methods", {})
    if not isinstance(methods, dict) or not all(isinstance(v, dict) for v in methods.values()):
        raise error(f"methods must hold tables ([methods.NAME]), got {methods!r}")
    out["methods"] = {k: dict(v) for k, v in methods.items()}
    for item in overrides:
        if "=" not in item:
            raise error(f"override {item!r} is not of the form section.key=value")
        path, text = item.split("=", 1)
        parts = path.strip().split(".")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare word, e.g. train.dataset=fashion-mnist
        except RecursionError:
            raise error(f"override {path.strip()}: value nested too deep to read") from None
        if parts[0] in sections and len(parts) == 2:
            out.setdefault(parts[0], {})[parts[1]] = value
        elif parts[0] == "methods" and len(parts) == 3:
            out["methods"].setdefault(parts[1], {})[parts[2]] = value
        else:
            raise error(f"override {item!r}: use {'|'.join(sections)}.KEY=VALUE or methods.LABEL.KEY=VALUE")
    return out


@dataclass(frozen=True)
class ConfigSchema:
    """One kind of config file: its plain tables, its error type, its shipped files' name prefix.

    ``label`` is how messages name a method table (``[methods.NAME]``); ``unknown_keys`` is the
    message for keys a table does not have (fields ``where``, ``bad``, ``allowed``).
    """

    sections: tuple[str, ...]
    error: type[ConfigError] = ConfigError
    prefix: str = ""
    label: str = "NAME"
    unknown_keys: str = "{where}: unknown key(s) {bad}; allowed: {allowed}"

    def shipped(self) -> dict[str, Path]:
        return shipped_configs(self.prefix)

    def load_raw(self, name_or_path: str) -> tuple[dict[str, Any], str]:
        return load_raw(name_or_path, self.prefix, self.error)

    def apply_overrides(self, raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
        return apply_overrides(raw, overrides, self.sections, self.error)

    def check_sections(self, raw: dict[str, Any]) -> None:
        """Only this schema's tables and ``methods``, and each of them a table."""
        allowed = (*self.sections, "methods")
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            names = ", ".join(f"[{s}]" for s in self.sections)
            raise self.error(f"unknown section(s) {unknown}; allowed: {names}, [methods.{self.label}]")
        for name in allowed:
            if not isinstance(raw.get(name, {}), dict):
                raise self.error(f"{name} must be a table ([{name}]{f'.{self.label}' if name == 'methods' else ''}), "
                                 f"got {raw[name]!r}")

    def fields(self, cls: type, where: str, raw: dict[str, Any], base: Any = None) -> dict[str, Any]:
        """``raw``'s values as keyword arguments of dataclass ``cls``, each coerced to the type of
        the field's default (or of ``base``'s value, where a base instance is given)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        bad = sorted(set(raw) - set(fields))
        if bad:
            raise self.error(self.unknown_keys.format(where=where, bad=bad, allowed=", ".join(fields)))
        ref = {k: getattr(base, k) if base is not None else _default(f) for k, f in fields.items()}
        items = _tuple_items(cls) if any(isinstance(ref[k], tuple) for k in raw) else {}
        either = _union_types(cls)  # a field of several types (int | str) takes a value of any of them as it is
        return {k: v if type(v) in either.get(k, ()) else coerce(f"{where}.{k}", v, ref[k], items.get(k), self.error)
                for k, v in raw.items()}

    def table(self, cls: type, raw: dict[str, Any], section: str) -> Any:
        """The ``[section]`` table of ``raw`` as an instance of frozen dataclass ``cls``."""
        return cls(**self.fields(cls, section, dict(raw.get(section, {}))))

    def methods(self, raw: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(label, a copy of the table)`` for each ``[methods.LABEL]``, in file order."""
        for label, opts in dict(raw.get("methods", {})).items():
            check_name(f"[methods.{label}] label", label, self.error)
            if not isinstance(opts, dict):
                raise self.error(f"methods.{label} must be a table")
            yield label, dict(opts)
