"""The benchmarks' two workloads on the bundled pair's held-out files (files it never trained on).

code: the first ``lines`` lines of a held-out stdlib file, to complete.
edit: a function from a held-out file, then a request to write it again with one identifier renamed,
      then its ``def`` line: "# original\\n<function>\\n# the same function with `x` renamed to
      `new_x`\\n<def line>" -- mostly a copy of the prompt, where lookup drafting shines.
"""
from __future__ import annotations

import ast
import os
import sysconfig
from typing import List, Tuple

WORKLOADS = ("code", "edit")


def _heldout_listing() -> str:
    from specdec_ext.default_pair import PAIR_DIR

    return os.path.join(PAIR_DIR, "heldout_files.txt")


def _heldout_paths() -> List[Tuple[str, str]]:
    """(name, path) of the bundled pair's held-out stdlib files that exist here, in the listing's order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    with open(_heldout_listing(), encoding="utf-8") as f:
        names = [line.strip() for line in f if line.strip().startswith("stdlib/")]
    return [(n, os.path.join(stdlib, n[len("stdlib/"):])) for n in names
            if os.path.isfile(os.path.join(stdlib, n[len("stdlib/"):]))]


def heldout_prompts(files: int, lines: int) -> List[Tuple[str, str]]:
    """(name, prompt) from the bundled pair's held-out list: the first ``lines`` lines of held-out stdlib
    files (the pair never trained on them); ``specdec demo``'s prompts and the code workload's."""
    out = []
    for name, path in _heldout_paths():
        try:
            with open(path, encoding="utf-8") as src:
                text = "".join(src.readlines()[:lines])
        except OSError:
            continue
        if text.strip():
            out.append((name, text))
        if len(out) == files:
            break
    if not out:
        raise SystemExit(f"specdec demo: none of the held-out files in {_heldout_listing()} exist under "
                         f"{sysconfig.get_paths()['stdlib']}")
    return out


def code_prompts(count: int, lines: int) -> List[str]:
    return [text for _, text in heldout_prompts(count, lines)]


def _functions(path: str, min_lines: int = 6, max_lines: int = 25):
    """(source, a local variable name) of small functions of a file, in order."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.col_offset != 0:
            continue
        n = node.end_lineno - node.lineno + 1
        if not min_lines <= n <= max_lines:
            continue
        names = [t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)]
        names = [x for x in dict.fromkeys(names) if len(x) >= 3]
        if names:
            yield "".join(lines[node.lineno - 1: node.end_lineno]), names[0]


def edit_prompts(count: int) -> List[str]:
    out = []
    for _, path in _heldout_paths():
        for function, name in _functions(path):
            first = function.splitlines(keepends=True)[0]
            out.append(f"# original\n{function}\n# the same function with `{name}` renamed to `new_{name}`\n{first}")
            break
        if len(out) == count:
            break
    return out


def workload_prompts(workload: str, count: int, lines: int) -> List[str]:
    """The prompt texts of a workload ("code" or "edit")."""
    if workload == "code":
        return code_prompts(count, lines)
    if workload == "edit":
        return edit_prompts(count)
    raise ValueError(f"unknown workload {workload!r}: expected one of {', '.join(WORKLOADS)}")
