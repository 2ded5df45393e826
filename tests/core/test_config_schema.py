"""The shared TOML config layer (``dqsgd.core.config_file``): coercion by field type, table and section checks,
dotted overrides, method tables and file lookup, with the messages both config kinds print."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass

import pytest

from dqsgd.core.config_file import ConfigError, ConfigSchema, coerce, load_raw, shipped_configs


class MyError(ConfigError):
    pass


@dataclass(frozen=True)
class Spec:
    name: str = "x"
    steps: int = 5
    lr: float = 0.5
    flag: bool = False
    seeds: tuple[int, ...] = (0,)
    sweep: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise MyError("spec: steps must be >= 1")


SCHEMA = ConfigSchema(("spec", "other"), MyError, label="LABEL")


def test_coerce_keeps_types_and_reads_ints_as_floats() -> None:
    assert coerce("s.lr", 2, 0.5) == 2.0 and type(coerce("s.lr", 2, 0.5)) is float
    assert coerce("s.n", 3, 1) == 3 and coerce("s.b", True, False) is True and coerce("s.s", "a", "") == "a"
    assert coerce("s.seeds", [1, 2], (0,)) == (1, 2)
    assert coerce("s.sweep", [1, 0.5], (), float) == (1.0, 0.5)
    assert all(type(v) is float for v in coerce("s.sweep", [1, 2], (), float))


@pytest.mark.parametrize("value,default,item,msg", [
    ("fast", 0.5, None, "s.k must be float, got 'fast'"),
    (True, 0.5, None, "s.k must be float, got True"),          # a bool is not a number
    (2.0, 1, None, "s.k must be int, got 2.0"),
    (True, 1, None, "s.k must be int, got True"),
    (1, False, None, "s.k must be bool, got 1"),
    (math.inf, 0.5, None, "s.k must be a finite number, got inf"),
    (math.nan, 0.5, None, "s.k must be a finite number, got nan"),
    ([0.5], (0,), None, "s.k must be a list of integers, got [0.5]"),
    ([True], (0,), None, "s.k must be a list of integers, got [True]"),
    (3, (0,), None, "s.k must be a list of integers, got 3"),
    (["a"], (), float, "s.k must be a list of numbers, got ['a']"),
    ([math.nan], (), float, "s.k must be a list of numbers, got [nan]"),
])
def test_coerce_refuses_with_the_key_named(value, default, item, msg) -> None:
    with pytest.raises(MyError) as e:
        coerce("s.k", value, default, item, MyError)
    assert str(e.value) == msg


def test_table_reads_item_types_from_the_annotations() -> None:
    spec = SCHEMA.table(Spec, {"spec": {"lr": 1, "seeds": [3, 4], "sweep": [1, 2]}}, "spec")
    assert spec == Spec(lr=1.0, seeds=(3, 4), sweep=(1.0, 2.0)) and type(spec.sweep[0]) is float
    assert SCHEMA.table(Spec, {}, "spec") == Spec()
    with pytest.raises(MyError, match=r"^spec.sweep must be a list of numbers"):
        SCHEMA.table(Spec, {"spec": {"sweep": ["a"]}}, "spec")
    with pytest.raises(MyError, match=r"^spec.seeds must be a list of integers"):
        SCHEMA.table(Spec, {"spec": {"seeds": [1.5]}}, "spec")
    with pytest.raises(MyError, match="steps must be >= 1"):  # the dataclass's own checks still run
        SCHEMA.table(Spec, {"spec": {"steps": 0}}, "spec")


def test_unknown_keys_are_named_with_the_allowed_ones() -> None:
    with pytest.raises(MyError) as e:
        SCHEMA.fields(Spec, "spec", {"stepz": 1, "a": 2})
    assert str(e.value) == "spec: unknown key(s) ['a', 'stepz']; allowed: name, steps, lr, flag, seeds, sweep"
    other = ConfigSchema(("spec",), unknown_keys="unknown {where} key(s) {bad}; allowed: {allowed}")
    with pytest.raises(ConfigError, match=r"^unknown spec key\(s\) \['a'\]; allowed: name, steps"):
        other.fields(Spec, "spec", {"a": 1})


def test_fields_against_a_base_instance() -> None:
    base = Spec(steps=9)
    assert SCHEMA.fields(Spec, "methods.m", {"lr": 3}, base) == {"lr": 3.0}
    with pytest.raises(MyError, match=r"^methods.m.steps must be int, got 'many'$"):
        SCHEMA.fields(Spec, "methods.m", {"steps": "many"}, base)


def test_sections_are_checked() -> None:
    SCHEMA.check_sections({"spec": {}, "other": {}, "methods": {"a": {}}})
    with pytest.raises(MyError) as e:
        SCHEMA.check_sections({"spec": {}, "zz": {}, "aa": 1})
    assert str(e.value) == "unknown section(s) ['aa', 'zz']; allowed: [spec], [other], [methods.LABEL]"
    with pytest.raises(MyError, match=r"^spec must be a table \(\[spec\]\), got 3$"):
        SCHEMA.check_sections({"spec": 3})
    with pytest.raises(MyError, match=r"^methods must be a table"):
        SCHEMA.check_sections({"methods": [1]})


def test_method_tables_in_file_order_as_copies() -> None:
    raw = {"methods": {"b": {"k": 1}, "a": {}, "c": {"k": 2}}}
    got = list(SCHEMA.methods(raw))
    assert got == [("b", {"k": 1}), ("a", {}), ("c", {"k": 2})]
    got[0][1].pop("k")
    assert raw["methods"]["b"] == {"k": 1}
    assert list(SCHEMA.methods({})) == []
    with pytest.raises(MyError, match=r"^methods.x must be a table$"):
        list(SCHEMA.methods({"methods": {"x": 3}}))


def test_overrides_parse_toml_values_and_leave_the_input_alone() -> None:
    raw = {"spec": {"steps": 1}, "methods": {"m": {"lr": 1.0}}}
    out = SCHEMA.apply_overrides(raw, ["spec.steps=7", "spec.name=fashion-mnist", "spec.seeds=[1, 2]",
                                       "other.flag=true", "methods.m.lr=0.25", "methods.n.k=\"v\"", "spec.eq=a=b"])
    assert out == {"spec": {"steps": 7, "name": "fashion-mnist", "seeds": [1, 2], "eq": "a=b"}, "other": {"flag": True},
                   "methods": {"m": {"lr": 0.25}, "n": {"k": "v"}}}
    assert raw == {"spec": {"steps": 1}, "methods": {"m": {"lr": 1.0}}}
    for bad, msg in [("spec.steps", "is not of the form section.key=value"),
                     ("zz.k=1", "use spec|other.KEY=VALUE or methods.LABEL.KEY=VALUE"),
                     ("spec.a.b=1", "use spec|other.KEY=VALUE"), ("methods.m=1", "use spec|other.KEY=VALUE")]:
        with pytest.raises(MyError, match=msg):
            SCHEMA.apply_overrides({}, [bad])
    with pytest.raises(MyError, match=r"^methods must hold tables"):
        SCHEMA.apply_overrides({"methods": {"m": 1}}, [])


def test_files_by_shipped_name_or_path(tmp_path) -> None:
    assert "table1-mnist" in shipped_configs() and set(shipped_configs("dq-")) == set(ConfigSchema((), prefix="dq-").shipped())
    assert all(n.startswith("dq-") for n in shipped_configs("dq-"))
    raw, source = load_raw("table1-mnist")
    assert "train" in raw and source.endswith("table1-mnist.toml")
    f = tmp_path / "c.toml"
    f.write_text("[spec]\nsteps = 3\n")
    assert SCHEMA.load_raw(str(f)) == ({"spec": {"steps": 3}}, str(f))
    with pytest.raises(MyError, match=r"^no config 'table1-mnist': not a file, and the shipped configs are dq-"):
        ConfigSchema((), MyError, prefix="dq-").load_raw("table1-mnist")
    f.write_text("[spec\n")
    with pytest.raises(MyError, match="malformed TOML"):
        SCHEMA.load_raw(str(f))


def test_both_config_kinds_share_the_error_type() -> None:
    from dqsgd.dq.config import DQConfigError
    from dqsgd.train import config as train_config

    assert train_config.ConfigError is ConfigError and issubclass(DQConfigError, ConfigError)


def test_the_module_imports_nothing_heavy() -> None:
    code = ("import sys, dqsgd.core.config_file; "
            "print(sorted(m for m in ('torch', 'numpy', 'numba') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr
