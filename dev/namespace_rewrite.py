#!/usr/bin/env python3
"""One-off, idempotent rewrite of a flatflower checkout to the `flatflower.` namespace (issue 43 item 2).

    python dev/namespace_rewrite.py [REPO]        (default: the current directory)

The repository keeps its top-level folders (common/, client/, server/, strategies/, tools/ and,
once it exists, runtime/); the installed wheel maps them under one top-level package
`flatflower` (pyproject [tool.setuptools] package-dir), and a checkout resolves them through
flatflower/__init__.py (it appends the repo root to the package's __path__). This script:

1. Python import statements: `from common.x import y` -> `from flatflower.common.x import y`,
   `import client.app as c` -> `import flatflower.client.app as c` (also `>>> ` doctest lines and
   the code blocks of .md files).
2. Dotted module paths naming a real module of ours (`tools.engines.worker`, `server.app:app`,
   `client.batch.Batch`): everywhere in non-Python files, and in Python only inside strings and
   comments (code names such as a variable `client.train(...)` stay; code uses of a module
   imported bare, `import x.y` then `x.y.z`, are rewritten too). Only PKG.sub where PKG/sub(.py)
   exists is touched, so `server.pem` / `ca.key` stay.
3. pyproject.toml: [tool.setuptools] packages + package-dir (generated from the folders),
   package-data, fab-include gets flatflower/**/*.py.

Prints every file it changed, then the remaining suspicious bare references for manual review.
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
PKGS = [p for p in ("common", "client", "server", "strategies", "tools", "runtime") if (ROOT / p / "__init__.py").exists()]
SKIP_DIRS = {".git", "dev", ".venv", "runs", "node_modules", "__pycache__", ".flwr", "build", "dist", ".pytest_cache"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".cfg", ".ini", ".txt", ".rst", ".env"}
PKG_ALT = "|".join(PKGS)


def submodules(pkg: str) -> set[str]:
    base = ROOT / pkg
    out = {p.stem for p in base.glob("*.py") if p.stem != "__init__"}
    out |= {p.name for p in base.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return out


SUBS = {p: submodules(p) for p in PKGS}
# PKG.sub where sub is one of PKG's modules/subpackages, not preceded by a name char, '.', '/' or '-'
DOTTED = re.compile(r"(?<![\w./-])(" + PKG_ALT + r")\.([A-Za-z_]\w*)\b")
FSTRING_DOTTED = re.compile(r"(?<![\w./-])(" + PKG_ALT + r")\.(?=\{)")
FROM_LINE = re.compile(r"(?m)^([ \t]*(?:>>> |\.\.\. )?)from (" + PKG_ALT + r")(?=[.\s])")
IMPORT_LINE = re.compile(r"(?m)^([ \t]*(?:>>> |\.\.\. )?)import (" + PKG_ALT + r")((?:\.\w+)*)([ \t]+as\b)?")


def _dotted(text: str, allowed=None) -> str:
    """Rule 2 over ``text``; ``allowed(start)`` says whether a match at ``start`` may change."""
    def sub(m: re.Match) -> str:
        if m.group(2) not in SUBS[m.group(1)] or (allowed and not allowed(m.start())):
            return m.group(0)
        return f"flatflower.{m.group(0)}"
    return DOTTED.sub(sub, text)


def rewrite_imports(text: str) -> tuple[str, set[str]]:
    """Rule 1; returns the new text and the packages imported bare without `as`."""
    bare: set[str] = set()
    text = FROM_LINE.sub(lambda m: f"{m.group(1)}from flatflower.{m.group(2)}", text)

    def imp(m: re.Match) -> str:
        if not m.group(4):
            bare.add(m.group(2))
        return f"{m.group(1)}import flatflower.{m.group(2)}{m.group(3)}{m.group(4) or ''}"
    return IMPORT_LINE.sub(imp, text), bare


def rewrite_python(text: str) -> str:
    text, bare = rewrite_imports(text)
    # offsets of string/comment tokens: rule 2 applies inside them; in code only for bare imports
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    spans: list[tuple[int, int]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                a = starts[tok.start[0] - 1] + tok.start[1]
                b = starts[tok.end[0] - 1] + tok.end[1]
                spans.append((a, b))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return text  # not Python we can read: only rule 1

    def fstring(m: re.Match) -> str:  # f"strategies.{stem}": a module path built in an f-string
        return f"flatflower.{m.group(0)}" if any(a <= m.start() < b for a, b in spans) else m.group(0)
    text = FSTRING_DOTTED.sub(fstring, text)
    spans = []  # offsets moved: recompute
    try:
        starts = [0]
        for line in text.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                spans.append((starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return text

    def allowed(pos: int) -> bool:
        if any(a <= pos < b for a, b in spans):
            return True
        return any(text.startswith(p + ".", pos) for p in bare)
    return _dotted(text, allowed)


def rewrite_pyproject(text: str) -> str:
    text = _dotted(text)
    packages = ["flatflower"]
    package_dir = {}
    for pkg in PKGS:
        package_dir[f"flatflower.{pkg}"] = pkg
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT).parts
            packages.append("flatflower." + ".".join(rel))
    pkg_lines = ",\n            ".join(", ".join(f'"{p}"' for p in packages[i:i + 4]) for i in range(0, len(packages), 4))
    dir_lines = "\n".join(f'"{k}" = "{v}"' for k, v in package_dir.items())
    block = ("[tool.setuptools]\n"
             "# One top-level package in site-packages: the repository's folders are mapped under\n"
             "# flatflower (nothing generic like common/ or tools/ to shadow or be shadowed; issue 43).\n"
             "# In a checkout, flatflower/__init__.py resolves the same names. Generated by the namespace\n"
             "# rewrite; tests/test_packaging.py keeps the list equal to the folders.\n"
             f"packages = [{pkg_lines}]\n\n"
             "[tool.setuptools.package-dir]\n" + dir_lines + "\n")
    # replace the old find block, or a previous generated block (idempotent)
    old = re.compile(r"\[tool\.setuptools\.packages\.find\]\n(?:[^\[\n].*\n|\n)*?(?=\n*\[)", re.M)
    gen = re.compile(r"\[tool\.setuptools\]\n(?:.*\n)*?\[tool\.setuptools\.package-dir\]\n(?:\".*\n)*", re.M)
    if gen.search(text):
        text = gen.sub(block, text, count=1)
    elif old.search(text):
        text = old.sub(block, text, count=1)
    text = re.sub(r"(?m)^tools = \[\"presets/\*\.toml\"\]", '"flatflower.tools" = ["presets/*.toml"]', text)
    if '"flatflower/**/*.py"' not in text:
        text = text.replace('fab-include = ["common/**/*.py",', 'fab-include = ["flatflower/**/*.py", "common/**/*.py",', 1)
    for pkg in ("runtime",):  # the merged runtime/ must travel in the FAB too
        if pkg in PKGS and f'"{pkg}/**/*.py"' not in text:
            text = text.replace('"tools/**/*.py"', f'"tools/**/*.py", "{pkg}/**/*.py"', 1)
    return text


def rewrite_dockerfile(text: str) -> str:
    """Rule 2, the image's import check (`python -c "import torch, common, ..."`: bare package
    names too) and a COPY of flatflower/ (and runtime/) beside the other folders."""
    text = _dotted(text)
    text = re.sub(r'(python -c "import [^"]*)', lambda m: re.sub(
        r"(?<=, )(" + PKG_ALT + r")(?=[,\s]|$)", r"flatflower.\1", m.group(1)), text)
    for folder in ["flatflower"] + [p for p in PKGS if p == "runtime"]:
        m = re.search(r"(?m)^COPY (--chown=\S+ )?common/ common/\n", text)
        if m and f" {folder}/ {folder}/" not in text:
            text = text[:m.start()] + f"COPY {m.group(1) or ''}{folder}/ {folder}/\n" + text[m.start():]
    return text


def files():
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS for part in rel.parts) or not path.is_file():
            continue
        if rel.parts[:2] == ("docs", "results") and path.suffix != ".py":
            continue  # stored study results: data, never rewritten
        if path.suffix in TEXT_SUFFIXES or path.name in ("Makefile",) or path.name.startswith("Dockerfile") \
                or rel.parts[0] in (".ci",):
            yield path


def main() -> None:
    changed = []
    for path in files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(ROOT)
        if str(rel) == "pyproject.toml":
            new = rewrite_pyproject(text)
        elif path.suffix == ".py":
            new = rewrite_python(text)
        elif path.name.endswith(".dockerignore"):
            new = text
            for folder in ["flatflower"] + [p for p in PKGS if p == "runtime"]:
                if f"!{folder}/" not in new and "!common/\n" in new:
                    new = new.replace("!common/\n", f"!{folder}/\n!common/\n", 1)
        elif path.name.startswith("Dockerfile"):
            new = rewrite_dockerfile(text)
        else:
            new, _ = rewrite_imports(text)
            new = _dotted(new)
        if new != text:
            path.write_text(new)
            changed.append(str(rel))
    print(f"packages: {PKGS}")
    print(f"changed {len(changed)} file(s):")
    for c in changed:
        print(f"  {c}")
    suspicious = re.compile(r"""["'`](""" + PKG_ALT + r""")\.[a-z_]+|-m (""" + PKG_ALT + r""")\.|^\s*(from|import) (""" + PKG_ALT + r""")\b""")
    print("remaining suspicious bare references (review by hand):")
    for path in files():
        try:
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = suspicious.search(line)
                if m and not (m.group(1) and not re.search(r"\b(" + PKG_ALT + r")\.(" + "|".join(
                        set().union(*SUBS.values())) + r")\b", line)):
                    print(f"  {path.relative_to(ROOT)}:{n}: {line.strip()[:140]}")
        except UnicodeDecodeError:
            pass


if __name__ == "__main__":
    main()
