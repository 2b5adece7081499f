"""The installed package coexists (issue 43): one top-level package, ``flatflower``, whose
import names are its files' paths (issue 57: flatflower/common/config.py is
flatflower.common.config; the repository's common/, client/, ... are links to those folders), so
editors, type checkers, ruff and package walkers follow them. The wheel runs beside another package
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
PUBLIC_API = ("flatflower/__init__.py", "flatflower/_halves.py", "flatflower/_simulation.py",
              "flatflower/_objects.py", "flatflower/params.py", "flatflower/tensors.py")


def test_the_wheel_lists_every_package_folder():
    """A new subpackage (a folder under flatflower/ with __init__.py, or the presets' folder of
    package data) must be in pyproject's explicit list, or the wheel silently lacks it; no
    package-dir mapping: an import name is its file's path."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = [".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "flatflower").rglob("__init__.py")]
    assert sorted(setup["packages"]) == sorted([*found, "flatflower.tools.presets"])
    assert setup["package-dir"] == {"": "."}  # names are paths: no mapping


def test_an_import_name_is_the_path_of_its_file_and_the_design_cards_folders_lead_there():
    import flatflower
    import flatflower.common.config as config

    assert Path(config.__file__) == ROOT / "flatflower" / "common" / "config.py"  # no link, no mapping
    assert [Path(p) for p in flatflower.__path__] == [ROOT / "flatflower"]
    for folder in FOLDERS:  # the repository's top-level folders: relative links into the package
        link = ROOT / folder
        assert link.is_symlink() and os.readlink(link) == f"flatflower/{folder}"
        assert (link / "__init__.py").resolve() == ROOT / "flatflower" / folder / "__init__.py"
    assert not {m for m in sys.modules if m.split(".")[0] in FOLDERS}, "nothing imports the bare names"


def test_walking_the_package_ends_and_finds_only_flatflowers_modules():
    """A documentation generator or a plugin scan walks the package: it ends (the repository
    root was part of the package and the walk recursed until RecursionError) and finds the
    modules under flatflower/ only (not flatflower.flatflower, flatflower.tests)."""
    import pkgutil

    import flatflower

    names = [m.name for m in pkgutil.walk_packages(flatflower.__path__, "flatflower.")]
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
             for p in (ROOT / "flatflower").rglob("*.py")}
    assert set(names) == files - {"flatflower"}


def test_jedi_goes_to_the_definition_in_the_checkouts_file():
    import jedi

    code = "from flatflower.common.config import RunConfig\nRunConfig\n"
    script = jedi.Script(code, path=str(ROOT / "probe.py"), project=jedi.Project(str(ROOT)))
    (found,) = script.goto(2, 3, follow_imports=True)
    assert Path(str(found.module_path)) == ROOT / "flatflower" / "common" / "config.py"
    assert "class RunConfig" in (ROOT / "flatflower" / "common" / "config.py").read_text().splitlines()[found.line - 1]


@pytest.mark.slow  # a cold mypy over torch's stubs: about a minute on 2 cores
def test_mypy_checks_the_public_api_and_resolves_its_modules(tmp_path):
    """The public API (docs/api.md, docs/own-algorithm.md) type-checks, and mypy finds
    flatflower's modules (it reported import-not-found for every one)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from flatflower.common.config import RunConfig\nreveal_type(RunConfig().lr)\n")
    out = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), *PUBLIC_API,
                          str(probe)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert 'Revealed type is "float"' in out.stdout


def test_ruff_sorts_flatflowers_imports_as_first_party(tmp_path):
    probe = ROOT / "tests" / f"probe_isort_{os.getpid()}.py"
    probe.write_text("import os\n\nimport torch\n\nfrom flatflower.common import config\n")
    try:
        out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "I",
                              str(probe)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        probe.unlink()
    assert out.returncode == 0, out.stdout  # first-party: a section of its own after the third-party


def test_the_fab_and_the_images_hold_each_file_once():
    """`flwr build` walks the app without following links: it ships flatflower/ once; the
    Dockerfiles copy flatflower/ (the links would copy the same files again)."""
    from flwr.cli.build import build_fab_from_disk
    import zipfile
    from io import BytesIO

    names = zipfile.ZipFile(BytesIO(build_fab_from_disk(ROOT))).namelist()
    assert len(names) == len(set(names))
    assert {n.split("/")[0] for n in names} == {".info", "pyproject.toml", "flatflower"}
    assert "flatflower/common/config.py" in names and "flatflower/tools/presets/digits-quick.toml" in names
    for dockerfile in (ROOT / "docker").glob("Dockerfile.superexec*"):
        if dockerfile.suffix == ".dockerignore":
            continue
        copies = [line.split()[-2] for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")]
        assert "flatflower/" in copies and not set(copies) & {f"{f}/" for f in FOLDERS}, dockerfile.name


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


@pytest.mark.slow
def test_the_wheel_holds_each_file_once_and_runs_the_own_algorithm_example(installed, tmp_path):
    """From the built wheel, no checkout: the example copied into a project of its own runs in
    the in-process and vectorised engines alike and passes the conformance kit."""
    import shutil

    record = (next(installed.glob("flatflower-*.dist-info")) / "RECORD").read_text().splitlines()
    files = [line.split(",")[0] for line in record]
    assert len(files) == len(set(files)) and "flatflower/common/config.py" in files
    assert "flatflower/py.typed" in files  # PEP 561: the installed package's annotations are read
    assert not [f for f in files if f.split("/")[0] in FOLDERS]
    project = tmp_path / "project"
    shutil.copytree(ROOT / "examples" / "own_algorithm", project, ignore=shutil.ignore_patterns("__pycache__"))
    finals = []
    for engine in ("inprocess", "vectorized"):
        out = run_installed(installed, project, [], "-m", "flatflower.tools.cli", "simulate", "--engine", engine,
                            "--algorithm", "emasam:spec", "--dataset", "digits", "--clients", "3", "--rounds", "2",
                            "--run-dir", str(tmp_path / engine))
        assert out.returncode == 0, out.stderr[-2000:]
        finals.append(json.loads((tmp_path / engine / "summary.json").read_text()))
    assert finals[0]["final_test_accuracy"] == finals[1]["final_test_accuracy"]
    out = run_installed(installed, project, [], "-m", "flatflower.tools.cli", "check-algorithm", "emasam:spec",
                        "--reference", "reference:first_round")
    assert out.returncode == 0 and out.stdout.count("PASS") == 7, out.stdout + out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.ray
def test_the_wheel_runs_the_own_algorithm_example_on_supernodes_and_ray(installed, tmp_path):
    """The same example from the wheel in a loopback deployment and on Flower's Ray engine: the
    generated app declares its keys, the nodes find and allow its module; both end at the
    in-process model's accuracy."""
    import shutil
    import tempfile

    project = tmp_path / "project"
    shutil.copytree(ROOT / "examples" / "own_algorithm", project, ignore=shutil.ignore_patterns("__pycache__"))
    accuracy = {}
    ray_tmp = tempfile.mkdtemp(prefix="ray-")  # Ray's socket paths must stay under 108 bytes
    try:
        for command, extra in (("simulate", ["--engine", "inprocess"]), ("local", []),
                               ("simulate", ["--engine", "ray"])):
            name = extra[-1] if extra else command
            out = run_installed(installed, project, [], "-m", "flatflower.tools.cli", command, *extra,
                                "--algorithm", "emasam:spec", "--dataset", "digits", "--clients", "2", "--rounds", "2",
                                "--run-dir", str(tmp_path / name), env={"RAY_TMPDIR": ray_tmp})
            assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
            accuracy[name] = json.loads((tmp_path / name / "summary.json").read_text())["final_test_accuracy"]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert accuracy["local"] == accuracy["inprocess"] == accuracy["ray"], accuracy
