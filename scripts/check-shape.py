#!/usr/bin/env python3
"""The house's shape rules, checked over the source tree (tests excluded):

- no source file over 1,200 lines;
- no function over 150 lines (Rust `fn` bodies by brace matching, Python `def` by indentation);
- no `use` circle between the files of a crate;
- `docs/design.md`'s code map (the table under "## Code map") names every source module that
  exists and nothing that does not: each row's first column holds backticked paths (a folder
  path ending in `/` covers the files below it).

A file's module may use its own descendants (a parent composes its children); every other
reference to a module of the same crate (`crate::…`, `super::…`, `self::…`, in `use`
declarations and in paths) is an edge from the file to the file that defines that module, and a
strongly connected set of two or more files is a circle.

Usage: scripts/check-shape.py [--root DIR] [--max-file N] [--max-fn N]. Exits 1 on a violation.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

FN_RE = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:default\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
    r'(?:extern\s+"[^"]*"\s+)?fn\s+(\w+)'
)
MOD_DECL_RE = re.compile(r"^\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.M)
PATH_RE = re.compile(r"\b((?:crate|self|super)(?:\s*::\s*\w+)+)")
USE_RE = re.compile(r"\buse\s+((?:crate|self|super)\s*::[^;]*);", re.S)


def tracked_files(root: Path) -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return [root / p for p in out.splitlines() if (root / p).is_file()]
    except (subprocess.CalledProcessError, FileNotFoundError):
        return [p for p in root.rglob("*") if p.is_file() and "target" not in p.parts]


def is_test_path(rel: Path) -> bool:
    parts = rel.parts
    return (
        "tests" in parts
        or "benches" in parts
        or rel.name in ("tests.rs", "conftest.py")
        or rel.name.startswith("test_")
        or parts[0] == "fuzz"
    )


def strip_rust(text: str) -> str:
    """Blanks comments, string and char literals (keeping newlines and lengths of lines)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            assert m
            close = '"' + m.group(1)
            j = text.find(close, i + len(m.group(0)))
            j = n if j < 0 else j + len(close)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def test_mod_ranges(lines: list[str]) -> list[tuple[int, int]]:
    """Line ranges of `#[cfg(test)] mod … { … }` blocks."""
    ranges = []
    for i, line in enumerate(lines):
        if line.strip() == "#[cfg(test)]":
            j = i + 1
            while j < len(lines) and lines[j].strip().startswith("#["):
                j += 1
            if j < len(lines) and re.match(r"\s*(pub\s+)?mod\s+\w+\s*\{", lines[j]):
                end = block_end(lines, j)
                ranges.append((i, end))
    return ranges


def block_end(lines: list[str], start: int) -> int:
    depth, seen = 0, False
    for k in range(start, len(lines)):
        for ch in lines[k]:
            if ch == "{":
                depth, seen = depth + 1, True
            elif ch == "}":
                depth -= 1
                if seen and depth == 0:
                    return k
        if not seen and lines[k].rstrip().endswith(";"):
            return k  # a declaration without a body
    return len(lines) - 1


def long_rust_fns(text: str, limit: int) -> list[tuple[str, int, int]]:
    lines = strip_rust(text).split("\n")
    skip = test_mod_ranges(lines)
    found = []
    for i, line in enumerate(lines):
        m = FN_RE.match(line)
        if not m or any(a <= i <= b for a, b in skip):
            continue
        end = block_end(lines, i)
        length = end - i + 1
        if length > limit:
            found.append((m.group(1), i + 1, length))
    return found


def long_py_fns(text: str, limit: int) -> list[tuple[str, int, int]]:
    lines = text.split("\n")
    found = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)(?:async\s+)?def\s+(\w+)", line)
        if not m:
            continue
        indent = len(m.group(1))
        end = i
        for k in range(i + 1, len(lines)):
            s = lines[k]
            if s.strip() and len(s) - len(s.lstrip()) <= indent and not s.lstrip().startswith(")"):
                break
            if s.strip():
                end = k
        if end - i + 1 > limit:
            found.append((m.group(2), i + 1, end - i + 1))
    return found


# ---- module graph ----------------------------------------------------------------------------


def module_tree(src: Path, root_file: Path) -> dict[tuple[str, ...], Path]:
    """Module path -> file, following `mod x;` declarations from a crate root."""
    mods: dict[tuple[str, ...], Path] = {(): root_file}
    todo = [((), root_file)]
    while todo:
        path, file = todo.pop()
        text = strip_rust(file.read_text(errors="replace"))
        if file.name in ("lib.rs", "main.rs", "mod.rs") or file == root_file:
            base = file.parent
        else:
            base = file.parent / file.stem
        for name in MOD_DECL_RE.findall(text):
            for cand in (base / f"{name}.rs", base / name / "mod.rs"):
                if cand.is_file():
                    mods[path + (name,)] = cand
                    todo.append((path + (name,), cand))
                    break
    return mods


def expand_use(tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> [`a::b`, `a::c::d`, `a::c::e`]."""
    tree = re.sub(r"\s+", "", tree)
    tree = re.sub(r"\bas\w+", "", tree)
    depth_start = tree.find("{")
    if depth_start < 0:
        return [tree]
    prefix = tree[:depth_start]
    inner = tree[depth_start + 1 : tree.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if not p:
            continue
        for e in expand_use(p):
            out.append(prefix + e if e != "self" else prefix.rstrip(":"))
    return out


def resolve(cur: tuple[str, ...], path: str) -> list[str] | None:
    segs = [s for s in re.split(r"\s*::\s*", path) if s]
    if not segs:
        return None
    if segs[0] == "crate":
        base, rest = [], segs[1:]
    else:
        base, rest = list(cur), segs
        while rest and rest[0] in ("self", "super"):
            if rest[0] == "super":
                if not base:
                    return None
                base.pop()
            rest = rest[1:]
    return base + rest


def crate_edges(mods: dict[tuple[str, ...], Path]) -> dict[Path, dict[Path, str]]:
    by_file = {f: m for m, f in mods.items()}
    edges: dict[Path, dict[Path, str]] = {f: {} for f in by_file}
    for file, cur in by_file.items():
        text = strip_rust(file.read_text(errors="replace"))
        paths = []
        for u in USE_RE.findall(text):
            paths.extend(expand_use(u))
        text_wo_use = USE_RE.sub("", text)
        paths.extend(PATH_RE.findall(text_wo_use))
        for p in paths:
            full = resolve(cur, p)
            if full is None:
                continue
            # the longest prefix that names a module
            target = None
            for k in range(len(full), -1, -1):
                if tuple(full[:k]) in mods:
                    target = tuple(full[:k])
                    break
            if target is None or target[: len(cur)] == cur:
                continue  # itself or a descendant
            tf = mods[target]
            edges[file].setdefault(tf, p.replace(" ", ""))
    return edges


def circles(edges: dict[Path, dict[Path, str]]) -> list[list[Path]]:
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on: set[Path] = set()
    out: list[list[Path]] = []
    counter = [0]

    def strong(v: Path) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            strong(v)
    return out


def code_map_problems(root: Path, files: list[Path]) -> list[str]:
    design = root / "docs" / "design.md"
    if not design.is_file():
        return []
    text = design.read_text()
    m = re.search(r"^## Code map\n(.*?)^## ", text, re.S | re.M)
    if not m:
        return ["code map: docs/design.md has no '## Code map' section"]
    named: list[str] = []
    for line in m.group(1).splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        first = line.split("|")[1]
        # A cell names its first path in full; the next may be short, relative to its folder
        # (`crates/x/src/a.rs`, `b.rs`, `b/c.rs`).
        base = ""
        for t in re.findall(r"`([^`]+)`", first):
            if t.startswith("crates/") or t.startswith("sdk/") or t.startswith("scripts/"):
                base = t if t.endswith("/") else t.rsplit("/", 1)[0] + "/"
                named.append(t)
            elif base and (t.endswith(".rs") or t.endswith(".py") or t.endswith("/")):
                named.append(base + t)
    problems = []
    for t in named:
        if not (root / t).exists():
            problems.append(f"code map: `{t}` does not exist")
    sources = []
    for f in files:
        rel = f.relative_to(root)
        if rel.parts[0] == "crates" and "src" in rel.parts and f.suffix in (".rs", ".py"):
            if not is_test_path(rel) and rel.name != "lib.rs":  # a crate root is its crate
                sources.append(str(rel))
    for s in sorted(sources):
        if not any(s == t or (t.endswith("/") and s.startswith(t)) for t in named):
            problems.append(f"code map: {s} is not named in docs/design.md")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--max-file", type=int, default=1200)
    ap.add_argument("--max-fn", type=int, default=150)
    args = ap.parse_args()
    root = Path(args.root).resolve()
    bad = 0
    files = tracked_files(root)
    for f in sorted(files):
        rel = f.relative_to(root)
        if f.suffix not in (".rs", ".py") or is_test_path(rel):
            continue
        if not (rel.parts[0] in ("crates", "sdk")):
            continue
        text = f.read_text(errors="replace")
        n = text.count("\n")
        if n > args.max_file:
            print(f"file  {rel}: {n} lines (> {args.max_file})")
            bad += 1
        fns = long_rust_fns(text, args.max_fn) if f.suffix == ".rs" else long_py_fns(text, args.max_fn)
        for name, line, length in fns:
            print(f"fn    {rel}:{line} {name}: {length} lines (> {args.max_fn})")
            bad += 1
    for crate in sorted((root / "crates").glob("*/src")):
        roots = [crate / r for r in ("lib.rs", "main.rs") if (crate / r).is_file()]
        roots += sorted((crate / "bin").glob("*.rs")) if (crate / "bin").is_dir() else []
        for r in roots:
            mods = module_tree(crate, r)
            for comp in circles(crate_edges(mods)):
                edges = crate_edges(mods)
                names = [str(c.relative_to(root)) for c in comp]
                detail = []
                for a in comp:
                    for b, via in edges[a].items():
                        if b in comp:
                            detail.append(f"{a.relative_to(crate)} -> {b.relative_to(crate)} ({via})")
                print("circle " + ", ".join(names))
                for d in detail:
                    print("         " + d)
                bad += 1
    for p in code_map_problems(root, files):
        print(p)
        bad += 1
    if bad:
        print(f"check-shape: {bad} violation(s)")
        return 1
    print("check-shape: files, functions and module imports within the house's limits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
