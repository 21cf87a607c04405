"""Packaging: `python -m build` makes an sdist and a wheel (the wheel from the sdist, so the sdist is complete); the
wheel installs in a fresh virtual environment with its dependencies, and from there `grayguard --version` says the
package version, every subcommand's --help works and `rules render`, `dashboards render` and `controller --check`
run on their own data (templates, dashboards, suites and calibration files inside the wheel).

Offline and quick: the build uses this environment's setuptools (--no-isolation), and the dependencies come from a
wheelhouse repacked from this environment's installed distributions (`pip install --no-index --find-links`)."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import io
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from grayguard import __version__

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def closure(name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The installed distributions name needs at run time (its requirements, recursively, markers evaluated)."""
    seen: set[str] = set()
    todo = [(name, extras)]
    while todo:
        n, ex = todo.pop()
        for r in md.requires(n) or []:
            req = Requirement(r)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (*ex, "")):
                continue
            key = re.sub(r"[-_.]+", "-", req.name).lower()
            if key not in seen:
                seen.add(key)
                todo.append((req.name, tuple(req.extras)))
    return seen


def repack(dist: md.Distribution, out: Path) -> Path:
    """An installable wheel of an installed distribution: the files its RECORD lists, with a fresh RECORD."""
    info = next(f for f in dist.files if f.parts[0].endswith(".dist-info"))
    tags = [ln.split(": ", 1)[1].split("-") for ln in dist.read_text("WHEEL").splitlines() if ln.startswith("Tag: ")]
    tag = "-".join(".".join(dict.fromkeys(t[i] for t in tags)) for i in range(3))  # py2-none-any + py3-.. = py2.py3-..
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    whl = out / f"{name}-{dist.version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files:
            if f.parts[0] == ".." or f.name == "RECORD" or "__pycache__" in f.parts or f.suffix == ".pyc":
                continue  # scripts outside site-packages are made again by pip; caches are not part of a wheel
            data = Path(dist.locate_file(f)).read_bytes()
            z.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append((str(f), f"sha256={digest}", str(len(data))))
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([*record, (f"{info.parts[0]}/RECORD", "", "")])
        z.writestr(f"{info.parts[0]}/RECORD", buf.getvalue())
    return whl


def checkout_copy(dst: Path) -> Path:
    """The checkout's tracked files (as they are in the working tree) copied to dst: setuptools writes its build
    trees (egg-info, the sdist's release tree) into the source folder, so the build gets a folder of its own that
    nothing else reads or writes meanwhile (`make test` runs other modules in a second process)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the sdist) `python -m build` makes of this checkout."""
    dist = tmp_path_factory.mktemp("dist")
    src = checkout_copy(tmp_path_factory.mktemp("src")) if (REPO / ".git").exists() else REPO
    b = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"grayguard-{__version__}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"grayguard-{__version__}.tar.gz"]
    return wheels[0], sdists[0]


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """The bin directory of a fresh venv with the freshly built wheel installed (its dependencies too)."""
    tmp = tmp_path_factory.mktemp("venv")
    house = tmp / "wheelhouse"
    house.mkdir()
    for dep in sorted(closure("grayguard")):
        repack(md.distribution(dep), house)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--find-links",
                          str(house), "--disable-pip-version-check", "--no-cache-dir", str(built[0])],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    return venv / "bin"


def run(bin_dir: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"  # promtool and the rest stay on PATH
    return subprocess.run([str(bin_dir / "grayguard"), *argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


DATA = ("rules/*.yml", "rules/templates/*.j2", "rules/tests/*.yml", "rules/tests/*.yaml", "dashboards/*.json",
        "dashboards/provisioning/*.yaml", "bench/suites/*.yaml", "sim/calibration/*.yaml")


def test_the_wheel_and_the_sdist_hold_what_the_commands_read(built):
    want = {str(p.relative_to(REPO)) for pat in DATA for p in REPO.glob(pat)}  # the checkout's, not a list here
    assert len(want) > 10
    with zipfile.ZipFile(built[0]) as z:
        names = set(z.namelist())
    assert want <= names, sorted(want - names)
    import tarfile
    with tarfile.open(built[1]) as t:
        sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    extra = {"grayguard.example.yaml", "haproxy/haproxy.example.cfg", "deploy/render.py",
             "deploy/systemd/grayguard-controller.service", "deploy/kubernetes/base/kustomization.yaml",
             "docs/operations.md", "MANIFEST.in"}
    assert want | extra <= sdist, sorted((want | extra) - sdist)


def test_the_built_wheel_installs_and_runs_every_subcommand(installed, tmp_path):
    v = run(installed, "--version", cwd=tmp_path)
    assert v.returncode == 0 and v.stdout.strip() == f"grayguard {__version__}"
    import grayguard.cli
    for name in grayguard.cli.SUBCOMMANDS:  # every subcommand imports and parses in the installed wheel
        h = run(installed, name, "--help", cwd=tmp_path)
        assert h.returncode == 0 and "usage: grayguard" in h.stdout, (name, h.stderr[-2000:])
    site = subprocess.run([str(installed / "python"), "-c", "import rules; print(rules.__file__)"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert str(REPO) not in site.stdout and "site-packages" in site.stdout  # the wheel's code, not this checkout's

    # the same files the checkout renders: the wheel's templates and dashboard code are complete
    from grayguard.dashboards.render import render_all as render_dashboards
    from grayguard.rules.render import render_all as render_rules

    from grayguard.config import load_config
    example = REPO / "grayguard.example.yaml"
    r = run(installed, "rules", "render", "--config", str(example), "--out", str(tmp_path / "rules"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name, text in render_rules(load_config(example)).items():
        assert (tmp_path / "rules" / name).read_text() == text
    d = run(installed, "dashboards", "render", "--out", str(tmp_path / "dash"), cwd=tmp_path)
    assert d.returncode == 0, d.stderr
    for name, text in render_dashboards().items():
        assert (tmp_path / "dash" / name).read_text() == text

    for config in (example, REPO / "deploy" / "kubernetes" / "base" / "controller" / "grayguard.yaml"):
        c = run(installed, "controller", "--config", str(config), "--check", cwd=tmp_path)
        assert c.returncode == 0 and "OK" in c.stdout, (config, c.stderr)
