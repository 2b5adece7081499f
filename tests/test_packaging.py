"""The installed package coexists (issue 43): one top-level package, ``flatflower``, whose
subpackages are the repository's folders (pyproject [tool.setuptools] package-dir); a checkout
resolves the same names through flatflower/__init__.py. The wheel runs beside another package
that ships ``common/config.py``, from a user project with its own ``common`` and ``tools``, and
with no checkout at all (the Flower App is generated: tools/prepare.py ``installed_app_dir``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("common", "client", "server", "strategies", "tools", "runtime")


def test_the_wheel_lists_every_package_folder():
    """A new subpackage (a folder with __init__.py) must be in pyproject's explicit list, or
    the wheel silently lacks it."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = ["flatflower"] + [f"flatflower.{'.'.join(init.parent.relative_to(ROOT).parts)}"
                              for folder in FOLDERS if (ROOT / folder).is_dir()
                              for init in (ROOT / folder).rglob("__init__.py")]
    assert sorted(setup["packages"]) == sorted(found)
    assert setup["package-dir"] == {f"flatflower.{f}": f for f in FOLDERS if (ROOT / f / "__init__.py").exists()}


def test_a_checkout_resolves_the_folders_under_flatflower():
    import flatflower
    import flatflower.common.config as config

    assert Path(config.__file__).resolve() == ROOT / "common" / "config.py"
    assert str(ROOT) in flatflower.__path__
    assert not {m for m in sys.modules if m.split(".")[0] in FOLDERS}, "nothing imports the bare names"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel installed into a bare directory (the test's PYTHONPATH holds only it)."""
    base = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(base / "dist"), str(ROOT)], check=True, capture_output=True, cwd=base)
    (wheel,) = (base / "dist").glob("flatflower-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(base / "site"),
                    str(wheel)], check=True, capture_output=True)
    return base / "site"


def user_project(tmp_path: Path) -> tuple[Path, Path]:
    """A user's project with its own common/ and tools/ packages, and another installed package
    that ships common/config.py (it would have overwritten flatflower's before)."""
    project = tmp_path / "project"
    for pkg in ("common", "tools", "client"):
        (project / pkg).mkdir(parents=True)
        (project / pkg / "__init__.py").write_text("MINE = True\n")
    (project / "common" / "config.py").write_text("raise ImportError('the user project common/config.py')\n")
    other = tmp_path / "other-site"
    (other / "common").mkdir(parents=True)
    (other / "common" / "__init__.py").write_text("")
    (other / "common" / "config.py").write_text("raise ImportError('another package common/config.py')\n")
    return project, other


def run_installed(site: Path, cwd: Path, extra: list[Path], *argv: str, timeout: int = 600,
                  env: dict[str, str] | None = None):
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(site), *map(str, extra)]),
           "FLWR_HOME": str(cwd / ".flwr"), "XDG_CACHE_HOME": str(cwd / ".cache"),
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_the_wheel_runs_beside_other_common_packages_and_outside_a_checkout(installed, tmp_path):
    project, other = user_project(tmp_path)
    code = ("import common, tools, flatflower, flatflower.common.config as c\n"
            "assert common.MINE and tools.MINE\n"
            "print(c.__file__)\n")
    out = run_installed(installed, project, [other], "-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(installed / "flatflower" / "common" / "config.py")
    out = run_installed(installed, project, [other], "-m", "flatflower.tools.cli", "simulate", "--engine",
                        "inprocess", "--clients", "2", "--rounds", "1", "--dataset", "digits",
                        "--algorithm", "fedavg")
    assert out.returncode == 0, out.stderr[-2000:]
    assert list((project / "runs").rglob("summary.json")), "the run wrote its run directory"


@pytest.mark.slow
@pytest.mark.integration
def test_the_installed_wheel_runs_local_with_no_checkout(installed, tmp_path):
    """`flatflower local` (real SuperLink and SuperNodes, `flwr run` of the generated App)."""
    project, _ = user_project(tmp_path)
    out = run_installed(installed, project, [], "-m", "flatflower.tools.cli", "local", "--clients", "2",
                        "--rounds", "1", "--dataset", "digits", "--algorithm", "fedavg")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert list((project / ".cache" / "flatflower").glob("app-*/pyproject.toml"))
    assert list((project / "runs").rglob("summary.json"))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.ray
def test_the_installed_wheel_runs_the_ray_engine_with_no_checkout(installed, tmp_path):
    """`flatflower simulate --engine ray` from a user project: the generated App's FAB carries no
    code, and Ray's workers import the installed flatflower."""
    import shutil
    import tempfile

    project, _ = user_project(tmp_path)
    ray_tmp = tempfile.mkdtemp(prefix="ray-")  # Ray's socket paths must stay under 108 bytes
    try:
        out = run_installed(installed, project, [], "-m", "flatflower.tools.cli", "simulate", "--engine", "ray",
                            "--clients", "2", "--rounds", "1", "--dataset", "digits", "--algorithm", "fedavg",
                            env={"RAY_TMPDIR": ray_tmp})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    (summary,) = (project / "runs").rglob("summary.json")
    assert json.loads((summary.parent / "config.json").read_text())["engine"] == "ray"
