"""docs/config.md lists every key of `[train]` and `[methods.LABEL]` with its default: a key added, removed or
given another default in the code without the page fails here (the page is the reference of every option)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from dqsgd.method.config import MethodConfig
from dqsgd.train.config import TrainConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _rows(section: str) -> dict[str, str]:
    """{key: default as written} of the table under the heading that starts with ``section``."""
    text = PAGE.read_text(encoding="utf-8")
    body = text.split(f"## `{section}`", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", body, re.M))


@pytest.mark.parametrize(("section", "cls", "prefix"), [("[train]", TrainConfig, "train."),
                                                       ("[methods.LABEL]", MethodConfig, "")])
def test_every_key_is_documented_with_its_default(section: str, cls: type, prefix: str) -> None:
    rows = _rows(section)
    fields = {prefix + f.name: f.default for f in dataclasses.fields(cls)}
    assert set(rows) == set(fields), (f"docs/config.md {section}: missing {sorted(set(fields) - set(rows))}, "
                                      f"not in the code {sorted(set(rows) - set(fields))}")
    wrong = {k: (rows[k], v) for k, v in fields.items() if ast.literal_eval(rows[k]) != v}
    assert not wrong, f"docs/config.md {section}: defaults (page, code) differ: {wrong}"
