"""The package's shape, measured from its source: no import circles, no module over 800 lines, no function over 100
lines (nor over 90 but those allowed, each with its reason), no private name imported from another module, and a
public surface of at most 22 names.

``python tests/test_layout.py`` prints the measures (the closing notes' before/after figures).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "memtrain"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100
# A function this long is near the cap: split it by concept (functions that read top to bottom) rather than trim it
# to fit. Lines are counted from ``def`` to the last line: the signature and the docstring are part of the reading.
NEAR_FUNCTION_LINES = 90
# The functions allowed over NEAR_FUNCTION_LINES, each with its reason; the aim is none.
NEAR_LIMIT_ALLOWED = {
    "memtrain.planner.search.plan": "the public entry point: a docstring for each of its 22 arguments, a 13-line body",
}
MAX_PUBLIC_NAMES = 22


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. "memtrain.planner.search"
    target: str  # the imported module
    names: tuple[str, ...]  # the names taken from it (empty for "import x")
    in_function: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """The memtrain imports of one module: at its top, inside functions and under ``if TYPE_CHECKING:`` alike."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] == "memtrain":
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        target = sub if sub in known else base  # "from memtrain.planner import search"
                        found.append(Import(name, target, (alias.name,) if target == base else (), inner))
            elif isinstance(child, ast.Import):
                found.extend(Import(name, a.name, (), inner) for a in child.names if a.name.split(".")[0] == "memtrain")
            visit(child, inner)

    visit(tree, False)
    return found


def all_imports() -> list[Import]:
    known = modules()
    return [i for name, path in known.items() for i in imports(name, path, known)]


def circles() -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (packages' __init__ files included)."""
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for i in all_imports():
        if i.target in graph and i.target != i.source:
            graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            connect(v)
    return groups


def module_lines() -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in modules().items()}


def function_lines() -> dict[str, int]:
    """Every function and method (nested ones inside their outer function), by qualified name: its lines, from
    ``def`` to its last line."""
    out = {}
    for name, path in modules().items():
        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{prefix}.{child.name}"] = child.end_lineno - child.lineno + 1
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}.{child.name}")

        visit(ast.parse(path.read_text()), name)
    return out


def long_functions(limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """The functions longer than ``limit`` lines, by qualified name."""
    return {name: n for name, n in function_lines().items() if n > limit}


def near_limit_functions() -> dict[str, int]:
    """The functions of NEAR_FUNCTION_LINES to MAX_FUNCTION_LINES lines, longest first."""
    near = {name: n for name, n in function_lines().items() if NEAR_FUNCTION_LINES <= n <= MAX_FUNCTION_LINES}
    return dict(sorted(near.items(), key=lambda kv: (-kv[1], kv[0])))


def private_imports() -> list[str]:
    """``from memtrain.x import _name`` in a module other than x (dunder names excepted)."""
    return sorted(f"{i.source} takes {n} from {i.target}" for i in all_imports() for n in i.names
                  if n.startswith("_") and not n.startswith("__") and i.source != i.target)


# What changes a model or steps it: only ``memtrain.planner.apply`` may take these, so the search stays pure.
TECHNIQUES = frozenset({"apply_checkpointing", "remove_checkpointing", "checkpoint_sequential", "compile_model",
                        "offload_activations", "ActivationOffloader", "build_optimizer", "CPUOffloadOptimizer",
                        "ComposedOptimizer", "BF16StateAdamW", "GradientAccumulator", "apply_chunked_loss",
                        "remove_chunked_loss", "MixedPrecision"})


def planner_techniques() -> list[str]:
    """Technique names taken by a planner module other than ``memtrain.planner.apply``."""
    return sorted(f"{i.source} takes {n}" for i in all_imports() for n in i.names
                  if i.source.startswith("memtrain.planner") and i.source != "memtrain.planner.apply"
                  and n in TECHNIQUES)


# The techniques' implementations: their own arguments bear the settings' names (build_optimizer(state_precision=)).
PRIMITIVES = ("memtrain.optim", "memtrain.checkpointing", "memtrain.offload", "memtrain.loss", "memtrain.precision",
              "memtrain.accumulation")
# Setting fields whose names say nothing else (``torch.compile``, ``apply_checkpointing``, a class's ``name``): not
# counted by ``setting_field_users``.
GENERIC_FIELDS = frozenset({"checkpointing", "compile", "optimizer", "placement", "name", "kwargs"})


def setting_field_users() -> dict[str, list[str]]:
    """Each technique's setting field (each ``Technique``'s ``fields`` and the optimizer's ``SETTING_FIELDS``)
    and the modules outside memtrain/techniques/ and the techniques' implementations (``PRIMITIVES``) that name it (an
    attribute or a keyword): the measure of "no module outside a technique's own names its setting fields", whose
    target is none."""
    from memtrain import techniques

    fields = {f for t in techniques.REGISTRY for f in t.fields} | set(techniques.optimizer.SETTING_FIELDS)
    users: dict[str, set[str]] = {f: set() for f in sorted(fields - GENERIC_FIELDS)}
    for name, path in modules().items():
        if name.startswith(("memtrain.techniques", *PRIMITIVES)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "techniques":
                continue  # a technique's module (techniques.chunked_loss), not its field
            named = node.attr if isinstance(node, ast.Attribute) else node.arg if isinstance(node, ast.keyword) \
                else None
            if named in users:
                users[named].add(name)
    return {f: sorted(m) for f, m in users.items()}


# The modules outside memtrain/techniques/ that still name a technique's setting field, each with its reason: the
# test holds the list (a module that starts naming one fails it; one that stops must be dropped from it).
FIELD_USERS_ALLOWED = {
    "memtrain.estimate.arguments": "estimate's arguments: trace's keywords beside the set-up's, checked against it",
    "memtrain.estimate.optimizer_state": "the estimator's optimizer bytes: optimizer_memory's keywords",
    "memtrain.estimate.prepare": "the estimator's step: the chunked loss and activation offload it traces",
    "memtrain.estimate.step": "trace's keywords: one per technique it models (as build_optimizer's are)",
    "memtrain.estimate.streamed_weights": "the estimator's note on a set-up that streams weights it does not model",
    "memtrain.planner.apply": "the stages call each implementation with its setting, in order (torchtitan's style)",
    "memtrain.planner.devices": "the probe times the host's pure bf16 AdamW (cpu_step_rate's keyword)",
    "memtrain.planner.hint": "the pure bf16 hint searches pure bf16 set-ups beside the plan",
    "memtrain.planner.search": "its progress line says when it searches pure bf16 set-ups (the hint's)",
    "memtrain.planner.tracing": "the profiles trace the loss whole and chunked (trace's keyword)",
}


def public_names() -> list[str]:
    """``memtrain.__all__``, read from the source (this checkout's, whichever memtrain is installed)."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def test_no_import_circles():
    assert circles() == []


def test_no_module_over_the_limit():
    over = {name: n for name, n in module_lines().items() if n > MAX_MODULE_LINES}
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_over_the_limit():
    assert long_functions() == {}, f"functions over {MAX_FUNCTION_LINES} lines"


def test_no_function_near_the_limit_but_those_allowed():
    near = {name: n for name, n in long_functions(NEAR_FUNCTION_LINES).items() if name not in NEAR_LIMIT_ALLOWED}
    assert near == {}, (f"functions over {NEAR_FUNCTION_LINES} lines: {near}. Split each by concept, or allow it in "
                        "NEAR_LIMIT_ALLOWED with a one-line reason")
    # An allowance names a function that exists, with one line of reason (a typo would allow nothing).
    assert set(NEAR_LIMIT_ALLOWED) <= set(function_lines()), set(NEAR_LIMIT_ALLOWED) - set(function_lines())
    assert all(reason and "\n" not in reason for reason in NEAR_LIMIT_ALLOWED.values())


def test_no_private_names_across_modules():
    assert private_imports() == []


def test_only_apply_plan_imports_the_techniques():
    assert planner_techniques() == []


def test_only_the_allowed_modules_name_a_techniques_setting_field():
    named = {m for ms in setting_field_users().values() for m in ms}
    assert named <= set(FIELD_USERS_ALLOWED), (
        f"{sorted(named - set(FIELD_USERS_ALLOWED))} name a technique's setting field: ask the technique (a method of "
        "its Technique, a function of its module), or allow the module in FIELD_USERS_ALLOWED with a one-line reason")
    assert set(FIELD_USERS_ALLOWED) <= named, f"{sorted(set(FIELD_USERS_ALLOWED) - named)}: drop them, they name none"


def test_public_surface():
    import memtrain

    names = public_names()
    assert len(names) <= MAX_PUBLIC_NAMES, f"{len(names)} names in memtrain.__all__"
    for name in names:
        assert hasattr(memtrain, name), name
    # The types the API takes are public too.
    for name in ("Checkpointing", "Choices", "MixedPrecision", "resolve_precision"):
        assert name in names, name


def _report() -> None:
    lines = module_lines()
    print(f"modules: {len(lines)}, lines: {sum(lines.values())}, the largest: "
          + ", ".join(f"{n} {c}" for n, c in sorted(lines.items(), key=lambda kv: -kv[1])[:6]))
    print(f"modules over {MAX_MODULE_LINES} lines: {sum(n > MAX_MODULE_LINES for n in lines.values())}")
    long = long_functions()
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(long)}"
          + (f" (the longest {max(long.values())}: {max(long, key=long.get)})" if long else ""))
    near = near_limit_functions()
    print(f"functions at {NEAR_FUNCTION_LINES}-{MAX_FUNCTION_LINES} lines: {len(near)}"
          + "".join(f"\n  {name} {n}" + (" (allowed)" if name in NEAR_LIMIT_ALLOWED else "")
                    for name, n in near.items()))
    stale = sorted(set(NEAR_LIMIT_ALLOWED) - set(long_functions(NEAR_FUNCTION_LINES)))
    if stale:
        print(f"allowed over {NEAR_FUNCTION_LINES} lines but no longer over: {', '.join(stale)} (drop them from "
              "NEAR_LIMIT_ALLOWED)")
    found = circles()
    print(f"import circles: {len(found)}" + "".join(f"\n  {', '.join(c)}" for c in found))
    print(f"private names imported across modules: {len(private_imports())}")
    print(f"imports inside functions: {sum(i.in_function for i in all_imports())}")
    print(f"technique names imported by the planner outside planner/apply: {len(planner_techniques())}")
    users = setting_field_users()
    print(f"modules naming a technique's setting field outside memtrain/techniques/ and the implementations: "
          f"{len({m for ms in users.values() for m in ms})} (each allowed in FIELD_USERS_ALLOWED with its reason)"
          + "".join(f"\n  {field} {len(ms)}" for field, ms in users.items()))
    print(f"memtrain.__all__: {len(public_names())} names")


if __name__ == "__main__":
    _report()
