"""The structural rules of issue 26: three checked over specdec_ext's source text (nothing imported or
run: the import graph, the function limits, no capability lookups on runners or drafters), one by
tracing a verifier call (the op wrappers' per-call path).

Each test names the rule it enforces and prints every offender (file:line) when it fails.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

PACKAGE = "specdec_ext"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

MAX_FUNCTION_LINES = 80  # lines of code: not blank, not only a comment, the docstring left out
MAX_PARAMETERS = 10  # self / cls not counted; *args and **kwargs count one each
# the public entry points keep their keyword arguments, as HF users expect (issue 26, item 3)
WIDE_SIGNATURES_ALLOWED = {("generate.py", "generate"), ("audit.py", "audit")}

# the plan/build stage: where a runner's or a drafter's optional capabilities may be looked up
CAPABILITY_LOOKUPS_ALLOWED = {"plan.py", "build.py", "serve/build.py"}
# getattr( / hasattr( whose first argument names a runner or a drafter: target, drafter, runner,
# self.runner, self._target, draft_runner, target_runner, ...
CAPABILITY_LOOKUP = re.compile(r"\b(getattr|hasattr)\(\s*(self\.)?_?(\w+_)?(target|drafter|runner)\s*,")

Edge = Tuple[str, int]  # (the importing file, relative to the package, and its line)


def _sources() -> Iterator[Tuple[str, Path]]:
    """(dotted module name, path) of every module of the package; a package is its __init__.py."""
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _compiled_modules() -> Set[str]:
    """The package's extension modules (``_C``): modules that import no Python module of the package."""
    found = set()
    for path in PACKAGE_DIR.rglob("*"):
        if path.suffix in (".so", ".pyd"):
            parts = path.relative_to(PACKAGE_DIR.parent).parts
            found.add(".".join(parts[:-1] + (path.name.split(".")[0],)))
    return found


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE_DIR).as_posix()


def _imported_modules(node: ast.AST, name: str, is_package: bool, modules: Set[str]) -> List[str]:
    """The package's modules an import statement imports, each where the imported names are defined:
    ``from pkg import sub`` (sub a module) imports pkg.sub; ``from pkg import obj`` imports pkg (its __init__)."""
    if isinstance(node, ast.Import):
        found = []
        for alias in node.names:
            parts = alias.name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts:
                found.append(".".join(parts))
        return found
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base not in modules:  # outside the package, or a compiled module (_C: it imports no Python module)
        return []
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def import_graph() -> Tuple[Dict[str, Dict[str, List[Edge]]], Dict[str, Path]]:
    """({module: {module it imports: [(file, line), ...]}}, {module: path}); every import statement counts,
    at module level, inside a function or a class, or under ``if TYPE_CHECKING``."""
    paths = dict(_sources())
    modules = set(paths) | _compiled_modules()
    graph: Dict[str, Dict[str, List[Edge]]] = {m: {} for m in modules}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            for imported in set(_imported_modules(node, name, path.name == "__init__.py", modules)) - {name}:
                graph[name].setdefault(imported, []).append((_relative(path), node.lineno))
    return graph, paths


def _strongly_connected(graph: Dict[str, Dict[str, List[Edge]]]) -> List[List[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _shortest_cycle(graph: Dict[str, Dict[str, List[Edge]]], component: List[str]) -> List[str]:
    """A shortest cycle through the component's first module, staying inside the component."""
    start, inside = component[0], set(component)
    previous: Dict[str, Optional[str]] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if child in inside and child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component


def _describe_cycle(graph: Dict[str, Dict[str, List[Edge]]], cycle: List[str]) -> str:
    steps = []
    for src, dst in zip(cycle, cycle[1:]):
        where = ", ".join(f"{file}:{line}" for file, line in graph[src][dst])
        steps.append(f"    {src} -> {dst}   ({where})")
    return "\n".join(steps)


def test_import_graph_has_no_cycles():
    """Issue 26, item 5: no import loops; every module's imports point down the layer diagram.

    Counted: every import statement of specdec_ext, at module level or inside a function (a lazy import is
    still a dependency), relative imports resolved. ``from pkg import name`` imports the submodule
    ``pkg.name`` where that is a module, else ``pkg`` itself (its __init__), the module that defines or
    re-exports the name.

    Package __init__ files: a package's __init__ may re-export its submodules, so it stands above them in
    the diagram; a submodule therefore imports what it needs from the sibling module that defines it
    (``from .base import Drafter``), never from its own package's __init__ (``from . import Drafter``,
    ``from ..drafters import Drafter``), which would be an edge back up and is reported as a cycle. The
    parent packages Python runs implicitly on the way to a submodule are not edges (every submodule would
    otherwise loop with an __init__ that re-exports it)."""
    graph, _ = import_graph()
    report = []
    for component in _strongly_connected(graph):
        cycle = _shortest_cycle(graph, component)
        report.append(f"  {' -> '.join(cycle)}\n{_describe_cycle(graph, cycle)}\n"
                      f"    (the modules that reach each other: {', '.join(component)})")
    assert not report, (f"import cycles in {PACKAGE} (a cycle, then each import in it, module -> the module it "
                        "imports, with the importing lines):\n" + "\n".join(report))


def _docstring_lines(function: ast.AST) -> Set[int]:
    body = getattr(function, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return set(range(body[0].lineno, body[0].end_lineno + 1))
    return set()


def _code_lines(function: ast.AST, lines: List[str]) -> int:
    """Lines from the def to the function's end that hold code: not blank, not only a comment, not the
    docstring (the lines of nested functions count for the function that holds them too)."""
    docstring = _docstring_lines(function)
    count = 0
    for number in range(function.lineno, function.end_lineno + 1):
        text = lines[number - 1].strip()
        if text and not text.startswith("#") and number not in docstring:
            count += 1
    return count


def _parameters(function: ast.AST) -> int:
    """Parameters of a def, self / cls (a method's first) not counted; *args and **kwargs count one each."""
    args = function.args
    positional = args.posonlyargs + args.args
    count = len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    if positional and positional[0].arg in ("self", "cls"):
        count -= 1
    return count


def function_offenders() -> List[str]:
    offenders = []
    for _, path in _sources():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{_relative(path)}:{node.lineno} {node.name}()"
            code = _code_lines(node, lines)
            if code > MAX_FUNCTION_LINES:
                offenders.append(f"{where}: {code} lines of code (at most {MAX_FUNCTION_LINES})")
            parameters = _parameters(node)
            if parameters > MAX_PARAMETERS and (_relative(path), node.name) not in WIDE_SIGNATURES_ALLOWED:
                offenders.append(f"{where}: {parameters} parameters (at most {MAX_PARAMETERS})")
    return offenders


def test_functions_are_short_and_narrow():
    """Issue 26, "Done when": no function in specdec_ext/ over 80 lines of code (not blank, not only a
    comment, the docstring left out) or over 10 parameters (self / cls not counted), except the public
    ``generate()`` and ``audit()`` signatures, which keep their keyword arguments (item 3)."""
    offenders = function_offenders()
    assert not offenders, "functions over the limits:\n" + "\n".join("    " + o for o in offenders)


def test_no_capability_lookups_on_runners_or_drafters():
    """Issue 26, item 2 and "Done when": no ``getattr``/``hasattr`` on a runner or a drafter outside the
    plan/build stage (plan.py, build.py, serve/build.py). A runner's or drafter's optional capabilities are
    declared (Protocols, flags) and resolved once into the plan; the loop branches on the plan, never on
    what an object happens to have. The check is a regex over the source: ``getattr(`` / ``hasattr(``
    whose first argument is named like a runner or a drafter (target, drafter, runner, draft_runner,
    self.runner, self._target, ...)."""
    offenders = []
    for _, path in _sources():
        if _relative(path) in CAPABILITY_LOOKUPS_ALLOWED:
            continue
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for match in CAPABILITY_LOOKUP.finditer(source):  # (the first argument may be on the next line)
            number = source.count("\n", 0, match.start()) + 1
            offenders.append(f"    {_relative(path)}:{number}: {lines[number - 1].strip()}")
    assert not offenders, ("getattr/hasattr on a runner or a drafter outside the plan/build stage:\n"
                           + "\n".join(offenders))


def _project_files_called(call) -> Set[str]:
    """The files of the package (relative paths) whose Python runs during ``call()``."""
    import sys

    files: Set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        call()
    except ValueError:
        pass  # a failed row: the files its error crossed are what is asked
    finally:
        sys.setprofile(None)
    inside = [Path(f).resolve() for f in files if Path(f).resolve().is_relative_to(PACKAGE_DIR)]
    return {_relative(path) for path in inside}


def test_a_verifier_call_runs_python_only_in_its_ops_module():
    """Issue 26, the op wrappers' per-call path (items 4 and 6: a step readable in few files): a call of
    ``specdec_ext.ops.chain_verify`` executes the package's Python only in ops/sampling.py (and
    _status.py when a row fails, to name the argument); ``tree_verify`` only in ops/tree.py and
    ops/sampling.py, where the verifiers' shared arguments live."""
    import torch

    from specdec_ext import ops

    logits, drafts = torch.randn(2, 3, 5), torch.zeros(2, 2, dtype=torch.int64)
    parents = torch.tensor([-1, 0], dtype=torch.int32)  # one tree for every row
    runs = {
        "chain_verify, seeded": (lambda: ops.chain_verify(logits, drafts, temperature=1.0, top_k=3, seed=1),
                                 {"ops/sampling.py"}),
        "chain_verify, seeds drawn": (lambda: ops.chain_verify(logits, drafts, temperature=0.5),
                                      {"ops/sampling.py"}),
        "chain_verify, a row fails": (lambda: ops.chain_verify(logits, drafts, temperature=-1.0, seed=1),
                                      {"ops/sampling.py", "_status.py"}),
        "tree_verify": (lambda: ops.tree_verify(logits, drafts, parents, temperature=1.0, seed=1),
                        {"ops/tree.py", "ops/sampling.py"}),
    }
    called = {name: _project_files_called(call) for name, (call, _) in runs.items()}
    wrong = {name: sorted(files) for name, files in called.items() if files != runs[name][1]}
    assert not wrong, f"project files a verifier call runs, other than expected: {wrong}"
