"""deploy/docker/Dockerfile and the repository's .dockerignore: the build context Docker would send (the ignore file
read as Docker reads it, tests/deploy/dockerignore.py) holds what the two wheels are built from and none of the
environments, caches and build outputs; the wheels build from that context alone; the default target installs the
production wheel only, the dev target adds grayguard-dev, both as the manifests run them (user, entrypoint).
`docker build` itself is not run here (no Docker daemon in the test environment)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.deploy import dockerignore as di
from tests.support.stack import require

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
IMAGE = "ghcr.io/grayguard/grayguard"
# what must never be in the context (some are absent from a fresh checkout: tests_excluded_names makes them)
NEVER = (".git/HEAD", ".venv/bin/python", ".venv-vllm/bin/python", "build/lib/grayguard/__init__.py",
         "dist/grayguard-0.1.0-py3-none-any.whl", "packaging/dev/build/lib/x.py", "controller/__pycache__/loop.pyc",
         "grayguard/x.pyc", "grayguard.egg-info/PKG-INFO", "packaging/dev/grayguard_dev.egg-info/PKG-INFO",
         "demo-report/index.html", "bench-report/report.json", ".pytest_cache/v/x", ".hypothesis/examples/x",
         ".ruff_cache/x", "tests/deploy/test_docker.py", "docs/operations.md")


# ---- the matcher: Docker's documented cases ------------------------------------------------------------------------
@pytest.mark.parametrize(("patterns", "path", "out"), [
    ("*/temp*", "somedir/temporary.txt", True),
    ("*/temp*", "somedir/temp", True),
    ("*/temp*", "temp.txt", False),                    # `*` is one level: not the root's
    ("*/*/temp*", "somedir/subdir/temporary.txt", True),
    ("temp?", "tempa", True),
    ("temp?", "tempab", False),
    ("**/*.go", "a.go", True),                        # `**/` may be no folder at all
    ("**/*.go", "x/y/a.go", True),
    ("*.md\n!README.md", "README.md", False),         # the last matching line wins
    ("*.md\n!README.md", "CHANGES.md", True),
    ("*.md\n!README*.md\nREADME-secret.md", "README-secret.md", True),
    ("tests", "tests/deploy/x.py", True),             # a folder takes its contents
    ("tests", "rules/tests/x.yml", False),            # a pattern without `**` names a path from the root only
    ("/build/", "build/x", True),                     # cleaned: the leading and trailing `/` go
    ("./a//b", "a/b/c", True),
    ("**/__pycache__", "a/b/__pycache__/x.pyc", True),
    ("**/*.py[cod]", "a/x.pyc", True),
    ("**/*.py[cod]", "a/x.py", False),
    ("x[^a]", "xb", True),
    ("x[^a]", "xa", False),
    ("a\\*b", "a*b", True),
    ("a\\*b", "axb", False),
    ("foo/**", "foo/a/b", True),
    ("# a comment\n\n   ", "# a comment", False),
])
def test_dockerignore_matches_as_docker_does(patterns, path, out):
    assert di.excluded(di.parse(patterns), path) is out


def ignore() -> list[di.Pattern]:
    return di.parse((REPO / ".dockerignore").read_text())


def wheel_sources() -> set[Path]:
    """The files a wheel build reads: each distribution's pyproject.toml, readme and license files, and its
    package-dir folders (the main wheel and grayguard-dev, whose folders are named from packaging/dev/)."""
    out = set()
    for proj in (REPO / "pyproject.toml", REPO / "packaging" / "dev" / "pyproject.toml"):
        doc = tomllib.loads(proj.read_text())
        here = proj.parent
        out |= {proj, here / doc["project"]["readme"], *(here / f for f in doc["project"]["license-files"])}
        out |= {(here / d).resolve() for d in doc["tool"]["setuptools"]["package-dir"].values()}
    return out


def tracked(paths: set[Path]) -> set[str]:
    """The files git tracks under paths (files or folders), relative to the repository."""
    rel = [str(p.relative_to(REPO)) for p in paths]
    out = subprocess.run(["git", "ls-files", "-z", "--", *rel], cwd=REPO, capture_output=True, text=True, check=True)
    return {f for f in out.stdout.split("\0") if f}


def test_the_context_holds_every_source_of_both_wheels():
    require("git")  # the tests run from a checkout (`make test`, .ci/run's clone): the tracked files are the sources
    assert (REPO / ".git").exists(), f"{REPO} is not a git checkout: the tracked files are unknown"
    ctx = set(di.context(REPO, ignore()))
    need = tracked(wheel_sources())
    assert {"pyproject.toml", "README.md", "LICENSE", "packaging/dev/pyproject.toml", "packaging/dev/LICENSE",
            "grayguard/__init__.py", "controller/loop.py", "sim/__init__.py"} <= need  # the list is real
    assert any(f.startswith("rules/tests/") for f in need)  # package data named `tests`, below the root
    assert need - ctx == set()


def test_the_context_leaves_out_environments_caches_and_build_outputs(tmp_path):
    (tmp_path / ".dockerignore").write_text((REPO / ".dockerignore").read_text())
    keep = ("pyproject.toml", "grayguard/__init__.py", "rules/tests/alerts_test.yml", "packaging/dev/pyproject.toml",
            "sim/fleet.py", "controller/build_plan.py")
    for f in (*NEVER, *keep):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")
    ctx = set(di.context(tmp_path, ignore()))
    assert ctx == set(keep)


def test_the_checkouts_context_has_nothing_it_must_not():
    ctx = list(di.context(REPO, ignore()))
    bad = [f for f in ctx if re.search(r"(^|/)(\.git|\.venv[^/]*|__pycache__|build|dist|[^/]*\.egg-info|demo-report|"
                                        r"bench-report|\.pytest_cache|\.hypothesis)(/|$)|\.py[cod]$", f)]
    assert bad == []
    assert len(ctx) < 2000, "the context is larger than the sources: an environment left in?"


# ---- the Dockerfile -------------------------------------------------------------------------------------------------
def stages(text: str) -> dict[str, dict]:
    """Each stage by name (or index): the image it starts FROM and its instructions (continuations joined)."""
    out: dict[str, dict] = {}
    cur = None
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?$", rest, re.I)
            cur = {"from": m.group(1), "lines": []}
            out[m.group(2) or str(len(out))] = cur
        else:
            cur["lines"].append((word.upper(), rest))
    return out


def chain(st: dict[str, dict], name: str) -> list[tuple[str, str]]:
    """A stage's instructions with those of the stages it builds on, first to last."""
    s = st[name]
    return (chain(st, s["from"]) if s["from"] in st else []) + s["lines"]


def test_the_default_target_installs_the_production_wheel_only():
    st = stages(DOCKERFILE.read_text())
    default = list(st)[-1]
    lines = chain(st, default)
    assert ("ENTRYPOINT", '["grayguard"]') in lines  # the manifests' args start with the subcommand
    assert [v for k, v in lines if k == "USER"][-1] == "65532:65532"  # their runAsUser
    run = " ".join(v for k, v in lines if k == "RUN")
    assert re.search(r"pip install .*--no-index .*--find-links /wheels grayguard$", run), run
    assert "grayguard-dev" not in run and "/wheels-dev" not in run
    dev = " ".join(v for k, v in chain(st, "dev") if k == "RUN")
    assert re.search(r"pip install .* grayguard grayguard-dev$", dev), dev
    assert [v for k, v in chain(st, "dev") if k == "USER"][-1] == "65532:65532"
    build = " ".join(v for k, v in st["build"]["lines"] if k == "RUN")
    assert "--wheel-dir /wheels ." in build and "--no-deps --wheel-dir /wheels-dev ./packaging/dev" in build


def test_the_build_commands_name_the_images_the_manifests_run():
    text = DOCKERFILE.read_text()
    assert f"-t {IMAGE}:$VERSION ." in text
    assert f"--target dev -t {IMAGE}-dev:$VERSION ." in text
    images = set()
    for f in (REPO / "deploy" / "kubernetes").rglob("*.yaml"):
        images |= set(re.findall(r"image: (ghcr\.io/grayguard/\S+)", f.read_text()))
    assert images == {IMAGE, f"{IMAGE}-dev"}  # components/version tags them


def test_the_wheels_build_from_the_context_alone(tmp_path):
    """What `pip wheel` does in the build stage, on a copy of the context (offline: this environment's setuptools)."""
    src = tmp_path / "src"
    for f in di.context(REPO, ignore()):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f, follow_symlinks=False)
    for args in ([".", "--wheel-dir", "wheels"], ["./packaging/dev", "--wheel-dir", "wheels-dev"]):
        p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", *args], cwd=src, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
    (main,) = (src / "wheels").glob("grayguard-*.whl")
    (dev,) = (src / "wheels-dev").glob("grayguard_dev-*.whl")
    main_names = zipfile.ZipFile(main).namelist()
    assert {"grayguard/__init__.py", "grayguard/controller/loop.py", "grayguard/exporters/cli.py",
            "grayguard/dashboards/grayguard-pool-overview.json"} <= set(main_names)
    assert any(n.startswith("grayguard/rules/templates/") for n in main_names)
    assert not any(n.startswith("grayguard/sim/") for n in main_names)
    assert any(n.startswith("grayguard/sim/") for n in zipfile.ZipFile(dev).namelist())
