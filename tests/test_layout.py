"""The package's shape, read from its source (ast, no imports run): no import cycle between its modules,
counting imports inside functions too, and each floor importing only from the floors below it:
    serving -> requests -> analysis -> runtime -> backends -> model -> (errors, knobs, units, memory)
(docs/architecture.md draws it). Each model family's names live in its own module under
model/families/ and nowhere else in the package."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = ["", "model", "backends", "runtime", "analysis", "requests", "serving"]   # bottom first
BOTTOM = {"errors", "knobs", "units", "memory"}


def _modules():
    """dotted module name -> source path, for colibri_edge/ and backends/ (installed as colibri_edge.backends)."""
    out = {}
    for top, prefix in (("colibri_edge", "colibri_edge"), ("backends", "colibri_edge.backends")):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, top))[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join([prefix] + rel)] = os.path.join(d, f)
    return out


MODULES = _modules()


def _is_pkg(name):
    return MODULES.get(name, "").endswith("__init__.py")


def imports_of(name):
    """Every module of the package that `name` imports, at module level or inside a function."""
    tree = ast.parse(open(MODULES[name]).read())
    here = name if _is_pkg(name) else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:            # `import colibri_edge.x.y` names a module or its package
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name and t != "colibri_edge":   # the root package re-exports the Engine only
                found.add(t)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def _cycles():
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
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
    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    """The reader finds the modules and their edges (a reader that saw nothing would pass the rest)."""
    assert len(MODULES) > 40
    assert "colibri_edge.runtime.runner" in GRAPH["colibri_edge.requests.engine"]
    assert "colibri_edge.errors" in GRAPH["colibri_edge.backends"]
    assert "colibri_edge.model.validate" in GRAPH["colibri_edge.runtime.rope"]


def test_no_import_cycle():
    assert _cycles() == []


def floor(name):
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in BOTTOM or parts[1] == "__main__":
        return -1 if len(parts) > 1 and parts[1] in BOTTOM else len(FLOORS)   # the root: above everything
    return FLOORS.index(parts[1]) if parts[1] in FLOORS else 0


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_run_downhill(name):
    """A module imports from its own floor or the floors below it, never from above."""
    uphill = sorted(t for t in GRAPH[name] if floor(t) > floor(name))
    assert uphill == [], f"{name} imports from a floor above it: {uphill}"


def _string_constants(path):
    return {n.value for n in ast.walk(ast.parse(open(path).read()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_family_names_live_in_their_family_module():
    """Every registered family's Hugging Face model_type and GGUF arch names are string constants of
    its own module under model/families/ and of no other module of the package (backends, the
    families' common module and the other family modules included): the drivers, the schema and the
    runtime know no family by name."""
    from colibri_edge.model import families
    owners = {}
    for fam in set(families.registry.BY_MODEL_TYPE.values()) | set(families.registry.BY_ARCH.values()):
        mod = type(fam).__module__
        for name in tuple(getattr(fam, "model_types", ())) + tuple(getattr(fam, "gguf_archs", ())):
            owners.setdefault(name, set()).add(mod)
    assert {"mixtral", "qwen3_5_moe", "deepseek2"} <= set(owners), "the registry lists the families"
    for name, path in MODULES.items():
        found = _string_constants(path) & set(owners)
        found = {n for n in found if name not in owners[n]}
        assert not found, f"{name} names families {sorted(found)} outside their family modules"


def test_no_test_imports_another_test_file():
    """Shared helpers live in tests/helpers.py (and the model builders in hf_models.py / gguf_models.py):
    no test file imports another test file or conftest.py, at module level or inside a test."""
    here = os.path.dirname(os.path.abspath(__file__))
    bad = []
    for f in sorted(os.listdir(here)):
        if not f.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(here, f)).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{f}: {n}" for n in names if n.split(".")[0].startswith("test_") or n == "conftest"]
    assert len(os.listdir(here)) > 20 and bad == []
