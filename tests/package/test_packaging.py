"""Packaging: the wheel's metadata and files, and `pip install` next to another torch keeps that torch.

The install test is real pip resolution, offline: an empty venv holds stub distributions (a torch at a
version other than requirements.txt's pin, and numpy/numba/zstandard), a stub wheel of the pinned torch
sits in a private find-links folder, and ``pip install --dry-run --no-index --report`` says what it would
install. The control (asking for the old exact pin) must install the other torch, so the check can fail.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIN = re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)  # type: ignore[union-attr]
OTHER_TORCH = "2.11.0"  # "a CUDA build of 2.11 already installed"
# pip sees only what the test provides: no config files, no PIP_* settings of this machine (find-links, indexes)
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull,
       "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, tree = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("tree")
    # build from a copy: setuptools writes build/ and src/*.egg-info next to the sources it builds
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-w", str(out), str(tree)], capture_output=True, text=True, timeout=240, env=ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("dqsgd-*.whl")
    return whl


def _metadata(whl: Path) -> tuple[list[str], dict]:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = Parser().parsestr(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    return names, meta


def test_wheel_metadata_ranges_extras_and_files(wheel: Path) -> None:
    import dqsgd

    names, meta = _metadata(wheel)
    assert meta["Version"] == dqsgd.__version__  # one source: setuptools reads dqsgd.__version__
    reqs = meta.get_all("Requires-Dist")
    core = [r for r in reqs if "extra ==" not in r]
    assert sorted(re.split(r"[<>=!~ ;\[]", r)[0] for r in core) == ["numba", "numpy", "torch", "zstandard"]
    assert not any("==" in r for r in core), core  # ranges, never exact pins
    torch_req = next(r for r in core if r.startswith("torch"))
    assert ">=2.3.1" in torch_req and PIN.split("+")[0] not in torch_req
    extras = {r.split("extra ==")[1].strip().strip("'\"") for r in reqs if "extra ==" in r}
    assert {"cli", "plots", "tensorboard", "data", "test", "gpu", "all"} <= extras
    assert any(r.startswith("matplotlib") and "plots" in r for r in reqs)
    assert any(r.startswith("tqdm") and "cli" in r for r in reqs)
    classifiers = meta.get_all("Classifier")
    for v in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {v}" in classifiers
    assert "dqsgd/py.typed" in names and "dqsgd/experiments/configs/table1-mnist.toml" in names
    assert {"dqsgd/cli/bench/common.py", "dqsgd/theory/checks.py", "dqsgd/experiments/theory_checks.py"} <= set(names)
    assert not any("benchmarks/" in n for n in names)  # `dqsgd bench codec|compressors|network` need a checkout
    src = ROOT / "src"
    assert {str(f.relative_to(src)) for f in (src / "dqsgd").rglob("*.py")} <= set(names)  # every module
    with zipfile.ZipFile(wheel) as z:
        scripts = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    module, function = re.search(r"^dqsgd = (\S+):(\w+)$", scripts, re.M).groups()  # type: ignore[union-attr]
    assert callable(getattr(importlib.import_module(module), function))  # the console script's target exists
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)


def test_pyproject_keeps_exact_pins_out_and_requirements_keeps_them() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" in project["dynamic"]
    assert all("==" not in d for d in project["dependencies"])
    assert f"torch=={PIN}" in (ROOT / "requirements.txt").read_text()


def _pins() -> dict[str, str]:
    pins = {}
    for name in ("requirements.txt", "requirements-test.txt", "requirements-data.txt"):
        for line in (ROOT / name).read_text().splitlines():
            if "==" in (line := line.split("#")[0].strip()):
                package, version = line.split("==")
                pins[package.strip().lower()] = version.strip()
    return pins


def test_the_extras_hold_the_tested_versions() -> None:
    """The GPU and TensorBoard extras have upper bounds, every extra's range holds the version `make`
    installs and tests (requirements*.txt), and `all` names every extra a user may want."""
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = _pins()
    assert {"triton", "tensorboard", "pytest", "hypothesis"} <= set(pins)  # what make test installs
    for extra, reqs in extras.items():
        for req in map(Requirement, reqs):
            if req.name != "dqsgd" and req.name.lower() in pins:
                assert req.specifier.contains(pins[req.name.lower()]), (extra, str(req), pins[req.name.lower()])
    for extra, name in (("gpu", "triton"), ("tensorboard", "tensorboard")):
        (req,) = map(Requirement, extras[extra])
        assert req.name == name and any(s.operator == "<" for s in req.specifier), req
    (everything,) = map(Requirement, extras["all"])
    assert everything.name == "dqsgd" and {"cli", "plots", "gpu", "tensorboard", "data"} <= everything.extras


def _stub_dist(site: Path, name: str, version: str) -> None:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "INSTALLER").write_text("stub\n")
    (d / "RECORD").write_text("")


def _stub_wheel(folder: Path, name: str, version: str) -> None:
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def _would_install(python: Path, links: Path, target: str) -> dict[str, str]:
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--no-index",
                          "--find-links", str(links), "--report", "-", "--quiet", target],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in report["install"]}


def test_pip_install_keeps_the_torch_it_finds(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    for name, version in [("torch", OTHER_TORCH), ("numpy", "2.4.6"), ("numba", "0.68.1"), ("zstandard", "0.25.0")]:
        _stub_dist(site, name, version)
    links = tmp_path / "links"
    links.mkdir()
    _stub_wheel(links, "torch", PIN.split("+")[0])
    # control: the old exact pin would replace the torch that is there
    assert _would_install(python, links, f"torch=={PIN.split('+')[0]}") == {"torch": PIN.split("+")[0]}
    # dqsgd's ranges keep it: only dqsgd itself is installed
    assert _would_install(python, links, str(wheel)) == {"dqsgd": _metadata(wheel)[1]["Version"]}
