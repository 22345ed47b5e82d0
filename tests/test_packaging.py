"""The built wheel is complete: it installs into a fresh virtual environment and every module imports from there.

The wheel is built from a clean copy of the source tree (no ``build/`` left in the working tree, no stale files
from an earlier ``build/lib``). The virtual environment has no system site packages: a ``.pth`` file puts this
interpreter's site-packages directories on its path (torch, lightning, ...) without running their ``.pth`` files, so
an editable install of this project (setuptools' editable finder is loaded by such a ``.pth`` file) can never shadow
the wheel, and a test run from inside a virtual environment sees that environment's packages (``venv
--system-site-packages`` would see the base interpreter's). The imports run outside the repository with
``PYTHONPATH`` unset, and every imported module must come from the virtual environment.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_paradyse"
# Extras that a module may import at module level: an ImportError naming one of them skips that module.
OPTIONAL = {"transformers", "matplotlib", "flash_attn"}
STEP_TIMEOUT = 120  # seconds, each subprocess

WALK = r"""
import importlib, json, pkgutil, sys

import lightning_paradyse as pkg


def error(err):
    names = []
    while err is not None:  # the ImportError, and what it was raised from
        if isinstance(err, ImportError) and err.name:
            names.append(err.name)
        err = err.__cause__ or err.__context__
    return names


found = {}


def onerror(name):
    err = sys.exc_info()[1]
    found[name] = {"error": f"{type(err).__name__}: {err}", "names": error(err)}


for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".", onerror=onerror):
    try:
        found[info.name] = {"file": importlib.import_module(info.name).__file__}
    except Exception as err:  # reported; only an ImportError naming an optional package passes
        found[info.name] = {"error": f"{type(err).__name__}: {err}", "names": error(err)}
print(json.dumps({"file": pkg.__file__, "modules": found}))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _source_modules() -> tuple[set[str], set[str]]:
    """(package directories, modules) of the source tree, as dotted names."""
    packages = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / PACKAGE).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    modules = set()
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parent = ".".join(path.parent.relative_to(ROOT).parts)
        if parent in packages:
            modules.add(parent if path.name == "__init__.py" else f"{parent}.{path.stem}")
    return packages, modules


def _ignore(folder: str, names: list[str]) -> set[str]:
    """What the copy of the tree leaves out: version control, caches and build outputs."""
    left_out = {n for n in names if n in (".git", "__pycache__") or n.endswith((".pyc", "_cache", ".egg-info"))}
    if Path(folder).resolve() == ROOT:
        left_out |= {n for n in names if n in ("build", "dist", ".venv", "lightning_logs", "runs")}
    return left_out


def _site_dirs() -> list[str]:
    dirs = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if Path(d).is_dir() and not Path(d).resolve().is_relative_to(ROOT)]


@pytest.mark.timeout(300)
def test_wheel_installs_and_imports(tmp_path: Path) -> None:
    assert not tmp_path.resolve().is_relative_to(ROOT), "the imports must run outside the repository"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONDONTWRITEBYTECODE="1")

    # build from a clean copy of the tree
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_ignore)
    dist = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        tmp_path,
        env,
    )
    (wheel,) = dist.glob(f"{PACKAGE}-*.whl")

    # every package directory and every module of the source tree is in the wheel
    packages, modules = _source_modules()
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    in_wheel = {n[: -len(".py")].replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py")}
    wheel_packages = {n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages - wheel_packages == set(), f"package directories missing from {wheel.name}"
    assert modules - in_wheel == set(), f"modules missing from {wheel.name}"
    assert PACKAGE in packages and f"{PACKAGE}.groups" in packages

    # a fresh virtual environment that sees this interpreter's packages, not its .pth files (editable finder)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env)
    purelib_dir = Path(purelib.strip())
    (purelib_dir / "_parent_site.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    _run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", str(wheel)], tmp_path, env
    )

    # import every module of the installed wheel, from outside the repository
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    out = json.loads(_run([str(python), "-c", WALK], run_dir, env).splitlines()[-1])
    installed = purelib_dir.resolve() / PACKAGE
    assert Path(out["file"]).resolve().is_relative_to(installed), f"imported {out['file']}, not the wheel"
    found: dict[str, dict[str, Any]] = out["modules"]
    skipped = set()
    for name, result in sorted(found.items()):
        if "file" in result:
            assert Path(result["file"]).resolve().is_relative_to(installed), f"{name} came from {result['file']}"
            continue
        optional = [n for n in result["names"] if n.split(".")[0] in OPTIONAL]
        assert optional, f"import {name} failed in the installed wheel: {result['error']}"
        skipped.add(name)
    # walk_packages does not enter a skipped package: its modules are the only ones it may not have seen
    unseen = {m for m in modules - set(found) - {PACKAGE} if not any(m.startswith(f"{p}.") for p in skipped)}
    assert unseen == set(), "modules of the source tree that pkgutil.walk_packages did not find in the wheel"
    assert set(found) <= modules, "modules in the wheel that the source tree lacks"


LAYERS = ("distributed", "modes", "graph", "runtime", "cost", "calibration", "planning", "groups", "lightning", "tools")
"""The package's folders in import order: a module imports only from its own folder and the folders before it."""
BESIDE = ("data", "models")
"""Folders beside the layers: they import the lower layers (up to ``cost``) and are imported by any."""


def _package_imports() -> list[tuple[str, int, str, bool]]:
    """``(module, line, imported module, at module level)`` for every import of the package inside the package."""
    import ast

    out = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        top = {id(statement) for statement in tree.body}  # module-level statements
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                names = [node.module] if node.module != PACKAGE else [f"{PACKAGE}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith(PACKAGE)]
            else:
                continue
            out += [(module, node.lineno, name, id(node) in top) for name in names]
    return out


def test_the_package_imports_only_downwards_and_at_module_level() -> None:
    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in (*LAYERS, *BESIDE)) else None

    upward, local = [], []
    for module, line, name, at_top in _package_imports():
        if not at_top:
            local.append(f"{module}:{line} imports {name} inside a function")
        a, b = folder(module), folder(name)
        if a is None or b is None or a == b:
            continue
        lower = LAYERS[: LAYERS.index("cost") + 1]
        if a in BESIDE and b in LAYERS and b not in lower:
            upward.append(f"{module}:{line} ({a}, beside) imports {name} ({b})")
        elif a in LAYERS and b in LAYERS and LAYERS.index(b) > LAYERS.index(a):
            upward.append(f"{module}:{line} ({a}) imports {name} ({b}, above it)")
    assert not upward and not local, "\n".join(upward + local)


def test_module_paths_of_earlier_versions_import_the_modules_at_their_place() -> None:
    import importlib

    import lightning_paradyse.models.spatial_temporal as spatial_temporal
    import lightning_paradyse.runtime.exactness as exactness
    import lightning_paradyse.runtime.parallel as parallel

    for old, new in (
        ("lightning_paradyse.guards", exactness),
        ("lightning_paradyse.runtime.guards", exactness),
        ("lightning_paradyse.models.st", spatial_temporal),
        ("lightning_paradyse.parallel", parallel),
    ):
        assert importlib.import_module(old) is new, old
