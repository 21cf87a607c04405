"""Packaging: `python -m build` makes an sdist and the production wheel (the wheel from the sdist, so the sdist is
complete), and the grayguard-dev wheel from that same sdist (packaging/dev/). The production wheel installs in a fresh
virtual environment with its dependencies, everything under the grayguard package; from there `grayguard --version`
says the package version, `rules render`, `dashboards render`, `controller --check` run on their own data and
`exporter --help` works, and there is no bench or demo command. `grayguard[dev]` then brings grayguard-dev and every
subcommand (suites and calibration files inside its wheel).

Offline and quick: the build uses this environment's setuptools (--no-isolation), and the dependencies come from a
wheelhouse repacked from this environment's installed distributions (`pip install --no-index --find-links`)."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import io
import json
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


def build(src: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    b = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), *args, str(src)],
                       capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    return b


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the wheel, the sdist, the grayguard-dev wheel) `python -m build` makes of this checkout; grayguard-dev's from
    the unpacked sdist, as a release builds it."""
    dist = tmp_path_factory.mktemp("dist")
    src = checkout_copy(tmp_path_factory.mktemp("src")) if (REPO / ".git").exists() else REPO
    build(src, dist)
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"grayguard-{__version__}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"grayguard-{__version__}.tar.gz"]
    import tarfile
    unpacked = tmp_path_factory.mktemp("sdist")
    with tarfile.open(sdists[0]) as t:
        t.extractall(unpacked, filter="data")
    build(unpacked / f"grayguard-{__version__}" / "packaging" / "dev", dist, "--wheel")
    devs = list(dist.glob("grayguard_dev-*.whl"))
    assert [d.name for d in devs] == [f"grayguard_dev-{__version__}-py3-none-any.whl"]
    return wheels[0], sdists[0], devs[0]


def fresh_venv(tmp: Path, *requirements: str, find_links: tuple[Path, ...] = ()) -> Path:
    """The bin directory of a fresh venv with requirements installed from a wheelhouse of this environment's
    distributions (grayguard's closure) and find_links, offline."""
    house = tmp / "wheelhouse"
    house.mkdir()
    for dep in sorted(closure("grayguard")):
        repack(md.distribution(dep), house)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    links = [a for d in (house, *find_links) for a in ("--find-links", str(d))]
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", *links,
                          "--disable-pip-version-check", "--no-cache-dir", *requirements],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    return venv / "bin"


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """The bin directory of a fresh venv with the production wheel installed (its dependencies too)."""
    return fresh_venv(tmp_path_factory.mktemp("venv"), str(built[0]))


def run(bin_dir: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"  # promtool and the rest stay on PATH
    return subprocess.run([str(bin_dir / "grayguard"), *argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def python(bin_dir: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(bin_dir / "python"), "-c", code], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


def offered_commands(bin_dir: Path, cwd: Path) -> list[str]:
    """The subcommands the installed `grayguard` offers (its parser's, as --help lists them)."""
    p = python(bin_dir, "import argparse, grayguard.cli as c; print(' '.join(next(a for a in c.build_parser()._actions "
               "if isinstance(a, argparse._SubParsersAction)).choices))", cwd=cwd)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


# (folder in the checkout, glob): the files the commands read at run time, and the wheel that must hold them
DATA = ("grayguard/config.schema.json", "grayguard/schemas/*.json", "rules/*.yml", "rules/templates/*.j2",
        "rules/tests/*.yml", "rules/tests/*.yaml", "dashboards/*.json", "dashboards/provisioning/*.yaml")
DEV_DATA = ("bench/suites/*.yaml", "bench/suites/traces/*", "bench/before34/*.y*ml", "sim/calibration/*.yaml",
            "localstack/vllm_site/*.py")
DEV_COMMANDS = ("bench", "bench-controller", "demo", "fleet", "loadgen")


def test_the_wheels_and_the_sdist_hold_what_the_commands_read(built):
    def want(patterns):  # the checkout's files, not a list here, at their place under the grayguard package
        return {str(rel) if rel.parts[0] == "grayguard" else f"grayguard/{rel}"
                for pat in patterns for rel in (p.relative_to(REPO) for p in REPO.glob(pat))}
    main, dev = want(DATA), want(DEV_DATA)
    assert len(main) > 10 and len(dev) > 4
    for wheel, files, other in ((built[0], main, dev), (built[2], dev, main)):
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
        assert files <= names, sorted(files - names)
        assert not other & names  # each file in one wheel only
    import tarfile
    with tarfile.open(built[1]) as t:
        sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    extra = {"grayguard.example.yaml", "haproxy/haproxy.example.cfg", "deploy/render.py", "LICENSE", "CHANGELOG.md",
             "deploy/systemd/grayguard-controller.service", "deploy/kubernetes/base/kustomization.yaml",
             "docs/operations.md", "MANIFEST.in", "packaging/dev/pyproject.toml"}
    on_disk = {str(p.relative_to(REPO)) for pat in DATA + DEV_DATA for p in REPO.glob(pat)}
    assert on_disk | extra <= sdist, sorted((on_disk | extra) - sdist)


def test_every_installed_file_is_under_the_grayguard_package(built):
    """Nothing lands in site-packages under a generic name (controller, rules, sim ...): each wheel's files are the
    grayguard package's, its dist-info, and the grayguard script; the dev wheel adds no grayguard/__init__.py."""
    for wheel, info in ((built[0], f"grayguard-{__version__}.dist-info"),
                        (built[2], f"grayguard_dev-{__version__}.dist-info")):
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            top_level = z.read(f"{info}/top_level.txt").decode().split()
        assert top_level == ["grayguard"]
        assert {n.split("/")[0] for n in names} == {"grayguard", info}, wheel.name
    with zipfile.ZipFile(built[2]) as z:
        assert not [n for n in z.namelist() if n.count("/") == 1 and n.startswith("grayguard/")]
    with zipfile.ZipFile(built[0]) as z:
        meta = z.read(f"grayguard-{__version__}.dist-info/METADATA").decode()
    assert f'Requires-Dist: grayguard-dev=={__version__}; extra == "dev"' in meta  # one version, both wheels


def test_the_production_wheel_runs_its_commands_and_has_no_dev_ones(installed, tmp_path):
    v = run(installed, "--version", cwd=tmp_path)
    assert v.returncode == 0 and v.stdout.strip() == f"grayguard {__version__}"
    found = python(installed, "import importlib.util as u; import grayguard, grayguard.controller, grayguard.rules; "
                   "print(grayguard.controller.__file__); "
                   "print([n for n in grayguard.COMPONENTS if u.find_spec(n) or u.find_spec('grayguard.' + n)])",
                   cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    where, importable = found.stdout.splitlines()
    assert str(REPO) not in where and "site-packages/grayguard/controller/" in where  # the wheel's code
    assert eval(importable) == ["controller", "exporters", "rules", "dashboards"]  # only as grayguard.<name>
    h = run(installed, "--help", cwd=tmp_path)
    assert h.returncode == 0 and "grayguard[dev]" in h.stdout
    offered = offered_commands(installed, tmp_path)
    assert not set(DEV_COMMANDS) & set(offered) and {"controller", "exporter", "rules", "dashboards"} <= set(offered)
    b = run(installed, "bench", "--help", cwd=tmp_path)
    assert b.returncode == 2 and "invalid choice" in b.stderr
    schema = run(installed, "config", "schema", cwd=tmp_path)  # the shipped JSON Schema, from inside the wheel
    assert schema.returncode == 0 and json.loads(schema.stdout) == json.loads(
        (REPO / "grayguard" / "config.schema.json").read_text()), schema.stderr
    e = run(installed, "exporter", "--help", cwd=tmp_path)
    assert e.returncode == 0 and "usage: grayguard exporter" in e.stdout, e.stderr[-2000:]

    # the same files the checkout renders: the wheel's templates and dashboard code are complete
    from grayguard.config import load_config
    from grayguard.dashboards.render import render_all as render_dashboards
    from grayguard.rules.render import render_all as render_rules
    example = REPO / "grayguard.example.yaml"
    r = run(installed, "rules", "render", "--config.file", str(example), "--out", str(tmp_path / "rules"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name, text in render_rules(load_config(example)).items():
        assert (tmp_path / "rules" / name).read_text() == text
    d = run(installed, "dashboards", "render", "--out", str(tmp_path / "dash"), cwd=tmp_path)
    assert d.returncode == 0, d.stderr
    for name, text in render_dashboards().items():
        assert (tmp_path / "dash" / name).read_text() == text

    for config in (example, REPO / "deploy" / "kubernetes" / "base" / "controller" / "grayguard.yaml"):
        c = run(installed, "controller", "--config.file", str(config), "--check", cwd=tmp_path)
        assert c.returncode == 0 and "OK" in c.stdout, (config, c.stderr)


def test_the_dev_extra_brings_every_subcommand(built, tmp_path):
    """`pip install 'grayguard[dev]'` beside the two wheels: grayguard-dev comes with it, every subcommand parses,
    and the benchmark finds its suites inside the wheel."""
    bin_dir = fresh_venv(tmp_path, "grayguard[dev]", find_links=(built[0].parent,))
    here = offered_commands(REPO / ".venv" / "bin", REPO) if (REPO / ".venv").exists() else []
    offered = offered_commands(bin_dir, tmp_path)
    assert set(DEV_COMMANDS) <= set(offered) and set(here) <= set(offered)  # all this checkout has
    for name in offered:
        h = run(bin_dir, name, "--help", cwd=tmp_path)
        assert h.returncode == 0 and "usage: grayguard" in h.stdout, (name, h.stderr[-2000:])
    assert "grayguard[dev]" not in run(bin_dir, "--help", cwd=tmp_path).stdout  # nothing left out
    s = python(bin_dir, "from grayguard.bench.scenarios import SCENARIO_DIR, suites; print(suites()); "
               "print(sorted(p.name for p in (SCENARIO_DIR / 'traces').iterdir()))", cwd=tmp_path)
    assert s.returncode == 0 and "'default'" in s.stdout and ".csv" in s.stdout, s.stderr
    assert "site-packages/grayguard" in python(bin_dir, "import grayguard.bench; print(grayguard.bench.__file__)",
                                               cwd=tmp_path).stdout
