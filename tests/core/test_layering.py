"""The package in tiers, read from its imports (ARCHITECTURE.md): arrows point down only, no circles.

Every ``import`` and ``from ... import`` of every module of the package and the adapters counts, at
module level or inside a function alike (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "apertus_plugins"
ADAPTERS = ("megatron_patches", "verl_ext", "vllm_model", "eval_tasks")

#: tier -> rank; a module may import its own tier (its own folder) and tiers of a lower rank only.
TIERS: dict[str, int] = {
    "infra": 0,
    "core": 1,
    "encoders": 2,
    "plugins": 3,
    "data": 4,
    "posttrain": 4,
    "hf": 4,
    "doctor": 5,
    "testing": 5,
    "cli": 6,
    **{a: 7 for a in ADAPTERS},
}
#: the commands that exist to make test material may use the testing fixtures
TESTING_USERS = {f"{PACKAGE}.cli.demo", f"{PACKAGE}.cli.make_checkpoint", f"{PACKAGE}.cli.make_tokenizer",
                 f"{PACKAGE}.cli.render"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    out = {}
    for top in (PACKAGE, *ADAPTERS):
        for path in (ROOT / top).rglob("*.py"):
            out[_module_name(path)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (resolved to the longest known module name).

    Importing a submodule runs its package's ``__init__`` too, in Python; that is not counted as a
    dependency on the package (else every ``from . import x`` would close a circle through it).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names]
            # ``from pkg import sub`` depends on the submodule; the package only for names it defines
            targets = [t for t in subs if t in known] or [mod]
            if len(targets) < len(subs):
                targets.append(mod)
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def tier(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in ADAPTERS:
        return parts[0]
    if parts[0] == PACKAGE and len(parts) > 1 and parts[1] in TIERS:
        return parts[1]
    return None


def test_every_module_of_the_package_is_in_a_tier() -> None:
    loose = sorted(m for m in modules() if tier(m) is None and m not in (PACKAGE, f"{PACKAGE}.assets"))
    assert loose == [], "modules outside every tier (put each in the folder of its tier)"


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    out = []
    for src, targets in g.items():
        a = tier(src)
        for dst in targets:
            b = tier(dst)
            if a is None or b is None or a == b:
                continue
            if TIERS[b] >= TIERS[a]:
                out.append(f"{src} -> {dst} ({a} {TIERS[a]} -> {b} {TIERS[b]})")
    return sorted(out)


def circles_of(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), a package's ``__init__``
    re-exporting its own submodules aside."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return [c for c in found if not _package_face(c)]


def _package_face(comp: list[str]) -> bool:
    """A package and the submodules it re-exports (``pkg/__init__`` <-> ``pkg.x``), nothing else."""
    return len(comp) == 2 and (comp[1].startswith(comp[0] + ".") or comp[0].startswith(comp[1] + "."))


def test_imports_point_down_only() -> None:
    assert upward_imports(graph()) == []


def test_product_code_never_imports_the_testing_fixtures() -> None:
    users = sorted(f"{src} -> {dst}" for src, targets in graph().items() for dst in targets
                   if tier(dst) == "testing" and tier(src) != "testing" and src not in TESTING_USERS)
    assert users == []


def test_there_is_no_import_circle() -> None:
    assert circles_of(graph()) == []


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """A core module that asks the registry is an upward import; two modules importing each other a circle."""
    src = tmp_path / "vocab.py"
    src.write_text("def f():\n    from apertus_plugins.plugins import registry\n    return registry()\n")
    name = f"{PACKAGE}.core.vocab"
    found = imports_of(name, src, modules())
    assert f"{PACKAGE}.plugins" in found
    assert upward_imports({name: found}) == [f"{name} -> {PACKAGE}.plugins (core 1 -> plugins 3)"]
    a, b = f"{PACKAGE}.core.vocab", f"{PACKAGE}.core.targets"
    assert circles_of({a: {b}, b: {a}}) == [[b, a]]
    assert circles_of({f"{PACKAGE}.core.chat": {f"{PACKAGE}.core.chat.parse"},
                       f"{PACKAGE}.core.chat.parse": {f"{PACKAGE}.core.chat"}}) == []
