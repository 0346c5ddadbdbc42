"""Copy parts of nanfuzz's own modules into an exported script, without what ties them to nanfuzz.

An exported repro runs where nanfuzz is not installed, yet it should run the
very code nanfuzz ran: a built-in kernel's Triton source, an adapter's call
into its library, the stand-ins for a library's runtime.  ``extract`` copies
a module's top-level statements as written (comments included), leaving out
its imports from nanfuzz and ``from __future__`` (the script has its own).
A name such a statement imported must then be defined by an earlier part of
the script; ``missing_names`` tells which are not, so the export fails here
rather than in the kernel author's hands.
"""
from __future__ import annotations

import ast
import builtins
import importlib.util
from pathlib import Path

from nanfuzz.reference.errors import NanfuzzError


def module_path(module: str) -> Path:
    """The file of nanfuzz module ``module`` ("harness.kernels.paged_decode")."""
    spec = importlib.util.find_spec(f"nanfuzz.{module}")
    assert spec is not None and spec.origin, module
    return Path(spec.origin)


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t] for t in targets]
        return {n.id for group in names for n in group if isinstance(n, ast.Name)}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


def _from_nanfuzz(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.module == "__future__" or (node.module or "").split(".")[0] == "nanfuzz"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "nanfuzz" for a in node.names)


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def extract(module: str, names: tuple[str, ...] | None = None, drop: tuple[str, ...] = ()) -> str:
    """The source of nanfuzz ``module``'s top-level statements, in order: those defining ``names``
    (every statement when None) and its other imports, less those defining a name in ``drop``.
    Each kept statement keeps the comment lines just above it."""
    path = module_path(module)
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    kept: list[tuple[bool, str]] = []
    previous_end = 0
    body = [node for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))
            and (names is None or _defined(node) & set(names)) and not _defined(node) & set(drop)]
    used = set().union(*(_loaded(node) for node in body)) if body else set()
    wanted = set(names or ())
    found: set[str] = set()
    for index, node in enumerate(tree.body):
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        leading = lines[previous_end:start - 1]
        previous_end = node.end_lineno
        defines = _defined(node)
        if _from_nanfuzz(node) or (index == 0 and _is_docstring(node)) or defines & set(drop):
            continue
        is_import = isinstance(node, (ast.Import, ast.ImportFrom))
        if names is not None and not is_import and not defines & wanted:
            continue
        found |= defines
        comments = [line for line in leading if line.strip().startswith("#")]
        if is_import:
            # only what the kept code reads: an import used in annotations alone (typing's Sequence)
            # would shadow a name another part defines
            aliases = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
            if not aliases:
                continue
            if len(aliases) < len(node.names):
                node.names = aliases
                kept.append((True, ast.unparse(node)))
                continue
        kept.append((is_import, "\n".join(comments + lines[start - 1:node.end_lineno])))
    absent = wanted - found
    assert not absent, f"{module} defines no {sorted(absent)}"
    parts = [f"# -- from nanfuzz's {path.parent.name}/{path.name} " + "-" * max(4, 60 - len(path.name))]
    for n, (is_import, chunk) in enumerate(kept):
        after_import = n > 0 and kept[n - 1][0]
        parts.append(("\n" if is_import and after_import else "\n\n\n") + chunk)
    return "".join(parts) + "\n"


def missing_names(source: str) -> list[str]:
    """Names a module-level statement of ``source`` loads that nothing in it defines (nor builtins):
    what a part copied without its imports would miss at run time.  Names read only inside
    functions count too; a function may run."""
    tree = ast.parse(source)
    defined = set(dir(builtins)) | {"__file__", "__name__"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    return sorted(_loaded(tree) - defined)


def _loaded(tree: ast.AST) -> set[str]:
    """Names read anywhere but in annotations (never evaluated under ``from __future__ import annotations``)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            names.add(node.id)
        for field, value in ast.iter_fields(node):
            if field in ("annotation", "returns"):
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    visit(child)

    visit(tree)
    return names


def check_complete(source: str, what: str) -> None:
    """An assembled script must define every name it reads; an internal error otherwise."""
    missing = missing_names(source)
    if missing:
        raise NanfuzzError(f"cannot export {what}: the script would lack {', '.join(missing)} (a nanfuzz bug)")
    seen: dict[str, int] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _defined(node):
                seen[name] = seen.get(name, 0) + 1
    twice = sorted(name for name, count in seen.items() if count > 1)
    if twice:
        raise NanfuzzError(f"cannot export {what}: parts of the script define {', '.join(twice)} twice (a nanfuzz bug)")
