"""A failing example saved in ``.hypothesis/`` never turns `make test` red, and `make fuzz` still replays it.

The suite's own conftest is copied into a scratch project with one property test whose only failing input
(7919317) is one that derandomized generation does not draw. A random-exploration run under the ``fuzz``
profile with a stricter bound finds, shrinks and saves exactly that input; from then on the fuzz profile
replays it and fails, while the default profile (what `make test` loads) passes in the same directory
with the saved example present.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLANTED = 7919317
PROPERTY = f'''
import os
from hypothesis import given, strategies as st


@given(st.integers(min_value=0, max_value=10**9))
def test_rare(x):
    limit = os.environ.get("PLANT_LIMIT")
    if limit is not None:  # the planting run: every x >= limit fails, shrinking ends at limit itself
        assert x < int(limit)
    else:  # afterwards only the planted value fails
        assert x != {PLANTED}
'''


def _pytest(cwd: Path, profile: str | None, plant: bool) -> subprocess.CompletedProcess[str]:
    # a developer's machine, not CI: Hypothesis's CI detection would turn its example database off by itself
    env = {k: v for k, v in os.environ.items()
           if k not in ("DQSGD_HYPOTHESIS", "PLANT_LIMIT", "CI", "TF_BUILD", "GITHUB_ACTIONS", "BUILDKITE",
                        "CIRCLECI", "CIRRUS_CI", "CODEBUILD_BUILD_ID", "GITLAB_CI", "HEROKU_TEST_RUN_ID",
                        "TEAMCITY_VERSION", "bamboo.buildKey")}
    if profile is not None:
        env["DQSGD_HYPOTHESIS"] = profile
    if plant:
        env["PLANT_LIMIT"] = str(PLANTED)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "test_rare.py"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_saved_failure_is_replayed_by_fuzz_only(tmp_path: Path) -> None:
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_rare.py").write_text(PROPERTY)

    planting = _pytest(tmp_path, "fuzz", plant=True)
    assert planting.returncode == 1, planting.stdout + planting.stderr
    assert f"x={PLANTED}" in planting.stdout, planting.stdout  # shrunk to the planted value
    assert any((tmp_path / ".hypothesis" / "examples").rglob("*")), "the fuzz profile saved nothing"

    replay = _pytest(tmp_path, "fuzz", plant=False)
    assert replay.returncode == 1, replay.stdout + replay.stderr  # the saved example fails again
    assert f"x={PLANTED}" in replay.stdout, replay.stdout

    default = _pytest(tmp_path, None, plant=False)  # what `make test` loads: the saved example is not read
    assert default.returncode == 0, default.stdout + default.stderr
