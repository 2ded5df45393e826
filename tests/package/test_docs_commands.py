"""Every `dqsgd …` and `torchrun … -m dqsgd …` line in the code blocks of README.md and docs/**/*.md
is run, one test per line (its id is FILE:LINE; a new page under docs/ is picked up by itself).

What "run" means, by command:
* ``train``, ``compare``, ``dq run``: with ``--dry-run`` added, which resolves the config and every
  override, loads the data, builds the model and checks the output directory and the resume target,
  then prints the plan (exit 0 and the plan's last line are checked). A refusal is accepted only
  when it is one clear line about something this machine lacks (CUDA, a dataset that is not
  installed, a placeholder path such as DIR): the test then skips, naming it.
* ``torchrun [opts] -m dqsgd train …``: torchrun's options are parsed by torchrun's own parser, and
  the dqsgd part dry-runs as rank 0 of WORLD_SIZE = nproc-per-node × nnodes (no process is started).
* ``train --resume RUN_DIR`` on a directory that does not exist yet: RUN_DIR is first made by a real
  2-step run of the same configuration (the run the page describes, shortened), then dry-run resumed.
* ``report RUN_DIR``: run for real on a fake finished comparison written at RUN_DIR
  (tests/experiments/fake_runs.py); the report file must appear.
* ``methods``, ``configs``, ``dq list``, ``--version``, ``--help``: run for real (they are instant).
* ``bench …``: parsed by the real parser only (sub-command and flags checked); each benchmark runs
  at small sizes in tests/test_bench_*.py.
* Synopsis lines (with ``[…]``, ``…`` or ``a|b`` alternatives): every named sub-command must exist.

The install lines are checked too (``test_documented_install_line``): ``make TARGET`` must be a target of
the Makefile (``make -n``: printed, not run), ``pip install '.[EXTRA,…]'`` must name extras of
pyproject.toml, ``pip install --no-deps PKG==V`` must be a pin of requirements*.txt, and ``python
benchmarks/…`` or ``examples/…`` must name a file of the checkout.

Data are loaded once per dataset for the whole module.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import dqsgd.cli.commands
import dqsgd.dq.problem
import dqsgd.experiments.compare

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
NOT_RUN_LANGS = {"python", "py", "toml", "json", "text", "txt", "output", "yaml", "ini", "diff"}
LACKS = re.compile(r"CUDA is not available|not installed|DatasetNotFound|no such file|not found|cannot find",
                   re.IGNORECASE)
REAL = {"methods", "configs", "--version", "--help", "-h"}


@dataclass(frozen=True)
class DocCommand:
    where: str      # FILE:LINE
    argv: tuple[str, ...]  # the words after `dqsgd` (or after `torchrun … -m dqsgd`)
    torchrun: tuple[str, ...] | None  # torchrun's own options, when launched by torchrun
    text: str


def _code_blocks(path: Path) -> list[list[tuple[int, str]]]:
    """The code blocks of a page as [(line number, text)]: fenced blocks (not in NOT_RUN_LANGS) and
    runs of 4-space-indented lines outside them; continuation lines (ending in a backslash) joined.
    In a block that shows prompts (``$ ``), only the prompted lines are commands (the rest is output)."""
    blocks: list[list[tuple[int, str]]] = []
    cur: list[tuple[int, str]] = []
    fence, lang, pending, start = None, "", "", 0
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = re.match(r"\s*(```+|~~~+)\s*([\w-]*)", line)
        if m and (fence is None or m.group(1).startswith(fence)):
            fence, lang = (None, "") if fence else (m.group(1), m.group(2).lower())
            blocks.append(cur)
            cur = []
            continue
        inside = fence is not None and lang not in NOT_RUN_LANGS
        if not (inside or (fence is None and line.startswith("    "))) and not pending:
            if line.strip() and fence is None:
                blocks.append(cur)
                cur = []
            continue
        start = start if pending else no
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        cur.append((start, text))
    blocks.append(cur)
    prompted = [[(n, t[2:]) for n, t in b if t.startswith("$ ")] for b in blocks]
    return [p or b for b, p in zip(blocks, prompted) if b]


def _parse(text: str) -> tuple[tuple[str, ...], tuple[str, ...] | None] | None:
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if words[:1] == ["dqsgd"]:
        return tuple(words[1:]), None
    if words[:3] == ["python", "-m", "dqsgd"]:
        return tuple(words[3:]), None
    if words[:1] == ["torchrun"] and "dqsgd" in words:
        i = words.index("dqsgd")
        if words[i - 1] == "-m":
            return tuple(words[i + 1:]), tuple(words[1:i - 1])
    return None


def doc_commands() -> list[DocCommand]:
    found = []
    for path in DOCS:
        for no, text in (line for block in _code_blocks(path) for line in block):
            parsed = _parse(text)
            if parsed is not None and parsed[0]:
                found.append(DocCommand(f"{path.relative_to(REPO)}:{no}", parsed[0], parsed[1], text))
    return found


COMMANDS = doc_commands()


def install_lines() -> list[tuple[str, list[str]]]:
    """(FILE:LINE, words) of every ``make …``, ``pip install …`` and ``python benchmarks|examples/…`` line."""
    found = []
    for path in DOCS:
        for no, text in (line for block in _code_blocks(path) for line in block):
            try:
                words = shlex.split(text, comments=True)
            except ValueError:
                continue
            words = words[1:] if words[:1] == ["sudo"] else words
            if words[:1] == ["make"] or words[:2] == ["pip", "install"] or (
                    words[:1] == ["python"] and len(words) > 1 and words[1].startswith(("benchmarks/", "examples/"))):
                found.append((f"{path.relative_to(REPO)}:{no}", words))
    return found


INSTALL_LINES = install_lines()


def test_the_readme_shows_how_to_install() -> None:
    readme = [w for where, w in INSTALL_LINES if where.startswith("README.md:")]
    assert ["make", "setup"] in readme and any(w[:2] == ["pip", "install"] for w in readme), readme


@pytest.mark.parametrize(("where", "words"), INSTALL_LINES, ids=[w for w, _ in INSTALL_LINES])
def test_documented_install_line(where: str, words: list[str]) -> None:
    import subprocess
    import tomllib

    if words[0] == "make":
        assert shutil.which("make"), "make is not installed"
        res = subprocess.run(["make", "-n", "-C", str(REPO), *words[1:]], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"{where}: `{' '.join(words)}` is not a Makefile target: {res.stderr}"
    elif words[0] == "pip":
        args = [w for w in words[2:] if not w.startswith("-")]
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        pins = {line.split("#")[0].strip().lower() for f in REPO.glob("requirements*.txt")
                for line in f.read_text().splitlines()}
        for arg in args:
            m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
            if m:
                missing = set((m.group(1) or "").split(",")) - {""} - set(extras)
                assert not missing, f"{where}: extras {sorted(missing)} are not in pyproject.toml"
            elif arg.startswith("-r"):
                assert (REPO / arg[2:]).is_file(), where
            else:
                assert arg.lower() in pins, f"{where}: `{arg}` is not a pin of requirements*.txt"
    else:
        assert (REPO / words[1]).is_file(), f"{where}: {words[1]} does not exist"


def test_the_pages_have_commands() -> None:
    assert len(COMMANDS) >= 10 and any(c.torchrun for c in COMMANDS), [c.where for c in COMMANDS]


# ---------------------------------------------------------------- running one line

@pytest.fixture(scope="module", autouse=True)
def _data_once():
    cached = functools.lru_cache(maxsize=None)(dqsgd.experiments.compare.load_dataset)

    def load(name, root=None, **kw):
        return cached(name, root, **dict(sorted(kw.items())))  # kwargs are hashable scalars

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dqsgd.experiments.compare, "load_dataset", load)
        mp.setattr(dqsgd.dq.problem, "load_dataset", load)
        yield


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = dqsgd.cli.commands.main(argv)
        except SystemExit as e:  # argparse: a bad flag, or --help / --version
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})


def _check_synopsis(cmd: DocCommand) -> None:
    p = dqsgd.cli.commands.parser()
    for word in cmd.argv:
        if word.startswith(("-", "[")) or not _subcommands(p):
            break
        names = word.split("|")
        missing = [n for n in names if n not in _subcommands(p)]
        assert not missing, f"{cmd.where}: `{cmd.text}` names sub-command(s) {missing} that do not exist"
        p = _subcommands(p)[names[0]]


def _resume_fixture(argv: list[str], run_dir: Path) -> None:
    """Make RUN_DIR by a real 2-step run of the configuration that the resume line continues."""
    drop = {"--resume": 1, "--transport": 1, "--workers": 1, "--max-restarts": 1, "--timeout": 1}
    make, i = [], 0
    while i < len(argv):
        if argv[i] in drop:
            i += 1 + drop[argv[i]]
            continue
        make.append(argv[i])
        i += 1
    m = re.fullmatch(r"runs/train/([^/]+)/([^/]+)/seed(\d+)", run_dir.as_posix())  # the default --out layout
    if m and "--config" not in make and "--method" not in make:
        make += ["--config", m.group(1), "--method", m.group(2), "--seed", m.group(3)]
    if "--transport" in argv and "--topology" not in make:
        make += ["--topology", "sharded"]  # what --transport torch would use
    rc, _, err = _run([*make, "--out", str(run_dir), "--set", "train.steps=2", "--quiet"])
    assert rc == 0, f"could not make the run to resume with {make}: {err}"


def _dry_run(cmd: DocCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = list(cmd.argv)
    if cmd.torchrun is not None:
        from torch.distributed.run import get_args_parser

        targs = get_args_parser().parse_args([*cmd.torchrun, "-m", "dqsgd"])
        nnodes = int(str(targs.nnodes).split(":")[-1])
        world = nnodes * int(targs.nproc_per_node)
        for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT="29500").items():
            monkeypatch.setenv(k, v)
    if argv[0] == "train" and "--resume" in argv:
        target = Path(argv[argv.index("--resume") + 1])
        if not target.exists():
            _resume_fixture(argv, target)
    rc, out, err = _run([*argv, "--dry-run"])
    if rc != 0 and LACKS.search(err) and err.strip().count("\n") == 0 and err.startswith(("dqsgd: error:", "error:")):
        pytest.skip(f"{cmd.where}: needs what this machine lacks: {err.strip()}")
    assert rc == 0, f"{cmd.where}: `{cmd.text}` --dry-run failed (exit {rc}):\n{err}"
    assert "dry run: nothing trained, nothing written" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command(cmd: DocCommand, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("examples", "benchmarks", "results", "docs"):  # what a page may point --config at
        if (REPO / name).exists():
            (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    argv = list(cmd.argv)
    if any(w.startswith("[") or w in ("...", "…") or ("|" in w and not w.startswith("-")) for w in argv):
        return _check_synopsis(cmd)
    head = argv[0]
    if head == "bench":  # parsed only: a bad sub-command or flag exits 2 here
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                dqsgd.cli.commands.parser().parse_args(argv)
            except SystemExit as e:
                pytest.fail(f"{cmd.where}: `{cmd.text}` does not parse (exit {e.code}): {err.getvalue()}")
        return None
    if head in REAL or argv[:2] == ["dq", "list"] or "--help" in argv:
        rc, out, err = _run(argv)
        assert rc == 0 and out, f"{cmd.where}: `{cmd.text}` failed (exit {rc}):\n{err}"
        return None
    if head == "report":
        spec = importlib.util.spec_from_file_location("fake_runs", REPO / "tests" / "experiments" / "fake_runs.py")
        fake = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fake)
        fake.make_root(Path(argv[1]))
        rc, out, err = _run(argv)
        assert rc == 0 and (Path(argv[1]) / "report.md").is_file(), f"{cmd.where}: `{cmd.text}` failed:\n{err}"
        return None
    assert head in ("train", "compare", "dq"), f"{cmd.where}: `{cmd.text}`: no treatment for `dqsgd {head}` here"
    return _dry_run(cmd, monkeypatch)
