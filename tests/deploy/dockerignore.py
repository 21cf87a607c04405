""".dockerignore as Docker reads it (moby's patternmatcher, which `docker build` and BuildKit share), for the tests:
each line a pattern relative to the context root, cleaned (`./a/` is `a`, a leading `/` dropped); `*` any run of
characters but `/`, `?` one of them, `[...]` a class (`[^...]` negated), `**` any number of folders (`**/` also
none), `\\` escapes; `!` re-includes; the last matching line wins; a path is matched when the pattern matches it or
one of its parent folders (a folder excluded takes its contents). Not Docker's: nothing here reads the Dockerfile's own
`<Dockerfile>.dockerignore`."""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pattern:
    text: str  # the cleaned pattern, without its `!`
    exclusion: bool  # a `!` line: re-includes what it matches
    regex: re.Pattern[str]


def compile_pattern(p: str) -> re.Pattern[str]:
    """The regular expression of one cleaned pattern, as moby's patternmatcher builds it."""
    out, i = "^", 0
    while i < len(p):
        ch = p[i]
        if ch == "*":
            if p[i + 1:i + 2] == "*":
                i += 1
                if p[i + 1:i + 2] == "/":
                    i += 1  # `**/` is `**`
                out += ".*" if i + 1 >= len(p) else "(.*/)?"
            else:
                out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\":
            i += 1
            out += re.escape(p[i]) if i < len(p) else "\\\\"
        elif ch == "[":
            j = p.find("]", i + 1)
            if j < 0:
                raise ValueError(f"{p!r}: an unterminated [")
            out += p[i:j + 1]  # as moby: the class goes to the regular expression as written (`[^a]` negates)
            i = j
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + "$")


def parse(text: str) -> list[Pattern]:
    """The patterns of a .dockerignore file, in order (comments and blank lines skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        line = line[1:].strip() if exclusion else line
        cleaned = posixpath.normpath(line).lstrip("/")
        if cleaned in ("", "."):
            continue
        out.append(Pattern(cleaned, exclusion, compile_pattern(cleaned)))
    return out


def excluded(patterns: list[Pattern], path: str) -> bool:
    """Whether Docker leaves `path` (relative, `/`-separated) out of the context."""
    parents = []
    parts = path.split("/")
    for n in range(1, len(parts)):
        parents.append("/".join(parts[:n]))
    hit = False
    for p in patterns:
        if p.regex.match(path) or any(p.regex.match(d) for d in parents):
            hit = not p.exclusion
    return hit


def context(root: Path, patterns: list[Pattern]) -> Iterator[str]:
    """Every file (and symlink) of the build context under root, as a relative `/`-separated path. A folder that is
    excluded is not walked when no `!` line could bring back something under it."""
    reinclusions = any(p.exclusion for p in patterns)
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        rel = "" if rel == "." else rel + "/"
        if not reinclusions:
            dirnames[:] = [d for d in dirnames if not excluded(patterns, rel + d)]
        for f in filenames:
            if not excluded(patterns, rel + f):
                yield rel + f
