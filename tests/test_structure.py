"""How bunshin's packages stand on each other, checked on the source (AST; no workspace).

- bunshin/fork/ makes and consumes bodies (bunshin.runtime.body) and never imports the
  Workspace handle (bunshin.runtime.workspace) built from them.
- runtime/, fork/, criu/ and speculate/ import each other at the top of a module only: an
  import inside a function between two of them would hide a circle.
- Their top-level imports, and those of every other bunshin module, form no circle.
- A module reads another module's private attributes (``x._name``) only where the allow-list
  below says so, and then with a ``# why:`` comment on the line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "bunshin"
LAYERED = ("runtime", "fork", "criu", "speculate")
# (module, line text): each a read of another module's private attribute, justified on its line
PRIVATE_READS_ALLOWED: set[tuple[str, str]] = set()
MAX_PRIVATE_READS = 5
# the modules of the handles runtime/ builds on what fork/ returns
HANDLES = ("bunshin.runtime.workspace", "bunshin.runtime.template", "bunshin.runtime.forking")


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PKG.parent)): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def _package(mod: str) -> str | None:
    parts = mod.split("/")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERED else None


def _imported(mod: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Dotted names ``node`` imports (modules and the names taken from them), made absolute."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    package = mod[:-3].replace("/", ".").split(".")[:-1]  # a module's, or __init__'s own
    base = package[: len(package) - node.level + 1] if node.level else []
    head = ".".join([*base, *([node.module] if node.module else [])])
    return [head, *(f"{head}.{a.name}" for a in node.names)]


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            for b in n.body:
                lines.update(range(b.lineno, (b.end_lineno or b.lineno) + 1))
    return lines


def test_fork_never_imports_the_workspace_handle() -> None:
    bad = []
    for mod, tree in _modules().items():
        if not mod.startswith("bunshin/fork/"):
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for name in _imported(mod, n):
                    if any(name == h or name.startswith(h + ".") for h in HANDLES):
                        bad.append(f"{mod}:{n.lineno} imports {name}")
    assert not bad, bad


def test_no_function_body_imports_between_layered_packages() -> None:
    bad = []
    for mod, tree in _modules().items():
        own = _package(mod)
        if own is None:
            continue
        guarded = _type_checking_lines(tree)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(fn):
                if not isinstance(n, (ast.Import, ast.ImportFrom)) or n.lineno in guarded:
                    continue
                for name in _imported(mod, n):
                    parts = name.split(".")
                    other = parts[1] if len(parts) > 1 and parts[0] == "bunshin" else None
                    if other in LAYERED and other != own:
                        bad.append(f"{mod}:{n.lineno} imports {name} inside {fn.name}()")
    assert not bad, bad


def _dotted(mod: str) -> str:
    name = mod[:-3].replace("/", ".")
    return name.removesuffix(".__init__")


def _top_level_imports() -> dict[str, set[str]]:
    """Each module's bunshin modules imported when it is (not in functions, not for type
    checking), without the packages it is in (Python imports those first anyway)."""
    mods = _modules()
    names = {_dotted(m) for m in mods}
    graph: dict[str, set[str]] = {}
    for mod, tree in mods.items():
        me, guarded, deps = _dotted(mod), _type_checking_lines(tree), set()

        def visit(stmts: list[ast.stmt], mod: str = mod, guarded: set[int] = guarded,
                  deps: set[str] = deps) -> None:
            for st in stmts:
                if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if isinstance(st, (ast.Import, ast.ImportFrom)):
                    if st.lineno not in guarded:
                        for name in _imported(mod, st):
                            while name and name not in names:
                                name = name.rpartition(".")[0]
                            deps.add(name)
                    continue
                for field in ("body", "orelse", "handlers", "finalbody"):
                    visit(getattr(st, field, None) or [])

        visit(tree.body)
        graph[me] = {d for d in deps if d and d != me and not me.startswith(d + ".")}
    return graph


def test_top_level_imports_form_no_circle() -> None:
    graph = _top_level_imports()
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*path[path.index(d):], d]
            if d not in state and (found := walk(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            circle = walk(m)
            assert circle is None, " -> ".join(circle)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: its functions, classes and methods, attributes it
    assigns (``self._x = ...``, ``obj._x = ...``), names assigned at module or class level, and
    names it imports."""
    out: set[str] = set()
    scopes: list[ast.AST] = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(n.name):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)) and _private(n.attr):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            name = (n.asname or n.name).split(".")[-1]
            if _private(name):
                out.add(name)
    for scope in scopes:
        for st in getattr(scope, "body", []):
            targets = st.targets if isinstance(st, ast.Assign) else [getattr(st, "target", None)]
            for t in targets:
                if isinstance(t, ast.Name) and _private(t.id):
                    out.add(t.id)
    return out


def private_reads() -> list[tuple[str, int, str]]:
    """Reads ``x._name`` (``x`` not self or cls) of a private name some other bunshin module
    defines and this one does not: another module's internals."""
    mods = _modules()
    defined = {m: _defined_private_names(t) for m, t in mods.items()}
    everywhere = set().union(*defined.values())
    out = []
    for mod, tree in mods.items():
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and _private(n.attr) and n.attr in everywhere
                    and n.attr not in defined[mod]
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))):
                out.append((mod, n.lineno, ast.unparse(n)))
    return sorted(out)


def test_private_reads_across_modules_are_few_and_justified() -> None:
    reads = private_reads()
    assert len(reads) <= MAX_PRIVATE_READS, reads
    sources = {m: (PKG.parent / m).read_text().splitlines() for m, _l, _e in reads}
    for mod, line, expr in reads:
        text = sources[mod][line - 1]
        assert (mod, text.strip()) in PRIVATE_READS_ALLOWED and "# why:" in text, \
            f"{mod}:{line} reads {expr}: use a public accessor, or allow it here with a '# why:'"


def test_tests_use_the_public_shells() -> None:
    here = Path(__file__).resolve().parent
    bad = [f"{p.name}:{i}" for p in sorted(here.glob("test_*.py")) if p.name != Path(__file__).name
           for i, line in enumerate(p.read_text().splitlines(), 1) if "._shells" in line]
    assert not bad, bad
