"""The front door stays one: README.md at most 200 lines, docs/README.md classifies every page of docs/,
results/README.md lists every folder of results/, and results/ follows its one naming scheme and holds no
scripts (they live in benchmarks/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_is_at_most_200_lines() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_docs_readme_classifies_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    missing = sorted(p for p in pages if f"]({p})" not in index)
    assert not missing, f"docs/README.md does not list {missing}"
    for heading in ("## Guides", "## Reference", "## Design", "## Measured results"):
        assert heading in index


def test_results_readme_lists_every_folder_and_one_naming_scheme() -> None:
    index = (ROOT / "results" / "README.md").read_text(encoding="utf-8")
    folders = sorted(p.name for p in (ROOT / "results").iterdir() if p.is_dir())
    missing = [f for f in folders if f"[`{f}/`]({f}/)" not in index]
    assert not missing, f"results/README.md does not list {missing}"
    for path in (ROOT / "results").rglob("*"):
        rel = path.relative_to(ROOT / "results")
        if path.is_dir():
            bad = [part for part in rel.parts[:2] if re.search(r"\d{4}-\d\d-\d\d|-r\d+$|_|^runs-", part)]
            assert not bad, f"results/{rel}: folder names are hyphenated settings, repeats -runN, no dates"
        assert path.suffix not in (".py", ".sh"), f"results/{rel}: scripts belong in benchmarks/"
