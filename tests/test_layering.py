"""The layers are true: what each module loads when imported, checked in a fresh process, and no
cycle of files at all (lazy imports included).

Layers, bottom up: common (shared names) -> config; quant; io_engine; store (reads families'
declarations); experts (serve store records); models (torch layers, never files or configs);
families (declare layouts; build models lazily); loader (assembles a model from a pack's tensors);
generate; chat; runtime; server; cli. docs/DESIGN.md has the table and the reasons.
"""
import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "lean_qwenflash"
ROOT = PKG.parent

ALL = {"common", "config", "quant", "io_engine", "store", "experts", "models", "families", "loader", "generate",
       "chat", "runtime", "server", "cli", "doctor", "repl", "hub"}

# area -> the areas of ours its modules may load (themselves and the native extensions always);
# checked on sys.modules after importing each module alone.
ALLOWED = {
    "": set(),                             # the package itself (and _host, which its import reads)
    "_host": set(),                        # host facts, standard library only: below every layer
    "common": set(),
    "config": {"common"},
    "quant": set(),
    "io_engine": set(),
    "families": {"common"},               # declarations only: build() imports models when called
    "store": {"common", "quant", "io_engine", "families"},
    "experts": {"common", "quant", "io_engine", "store", "families"},
    "models": {"common", "quant"},
    "loader": {"common", "quant", "io_engine", "store", "families", "experts", "models"},
    "generate": {"common", "quant", "models", "families", "chat"},
    "chat": set(),
    "runtime": ALL - {"server", "cli", "doctor", "repl", "hub"},
    "doctor": ALL - {"server", "cli", "repl", "hub"},
    "repl": ALL - {"server", "cli", "doctor", "hub"},
    "server": ALL - {"cli", "repl", "doctor", "hub"},
    "hub": ALL - {"server", "cli", "repl", "doctor", "runtime"},     # `pull`: the Hub, then the packer
    "cli": ALL,
}


def _area(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _modules() -> list:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        if rel.parts[0] == "default_model" or rel.name == "__main__":
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out.append(".".join(("lean_qwenflash",) + parts))
    return out


# Heavy third-party imports are done once in the parent; each child then imports one module of ours
# alone (fork: a fresh sys.modules for our package) and reports which of ours it loaded.
_PROBE = textwrap.dedent("""
    import json, os, sys
    import torch, numpy, yaml  # noqa: F401  (third-party: shared by every child)
    modules = json.loads(sys.argv[1])
    result = {}
    for name in modules:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                __import__(name)
                loaded = sorted(m for m in sys.modules if m.startswith("lean_qwenflash"))
                msg = json.dumps(loaded)
            except Exception as e:  # an import error is a failure the test reports
                msg = json.dumps({"error": f"{type(e).__name__}: {e}"})
            os.write(w, msg.encode())
            os._exit(0)
        os.close(w)
        chunks = []
        while True:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(r)
        os.waitpid(pid, 0)
        result[name] = json.loads(b"".join(chunks))
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def loaded():
    modules = _modules()
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(modules)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_every_module_loads_only_its_layers(loaded):
    problems = []
    for name, mods in loaded.items():
        if isinstance(mods, dict):
            problems.append(f"{name}: {mods['error']}")
            continue
        area = _area(name)
        allowed = ALLOWED[area] | {area, ""}
        extra = sorted(m for m in mods if _area(m) not in allowed and not m.startswith("lean_qwenflash._"))
        if extra:
            problems.append(f"{name} ({area}) loads {', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}")
    assert not problems, "\n".join(problems)


def test_config_is_a_leaf():
    """Importing the config loads nothing of ours but the shared names, and no torch."""
    code = ("import sys, lean_qwenflash.config; "
            "print(sorted(m for m in sys.modules if m.startswith('lean_qwenflash') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert ast.literal_eval(out.stdout.strip()) == ["lean_qwenflash", "lean_qwenflash._host", "lean_qwenflash.common",
                                                    "lean_qwenflash.config"]


def _imports(path: Path, module: str, known: set) -> set:
    """Modules of ours a file names in any import statement (lazy ones too)."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("lean_qwenflash"):
                continue
            for alias in node.names:       # `from pkg import submodule` names the submodule
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lean_qwenflash"))
    return {m for m in out if m in known and m != module}


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return comps


def _graph() -> dict:
    known = set(_modules())
    graph = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        if rel.parts[0] == "default_model" or rel.name == "__main__":
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        name = ".".join(("lean_qwenflash",) + parts)
        graph[name] = _imports(path, name, known)
    return graph


def test_no_cycle_of_files_lazy_or_not():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checkers_see_imports_and_cycles():
    graph = _graph()
    assert "lean_qwenflash.experts.provider" in graph["lean_qwenflash.loader"]
    assert "lean_qwenflash.store.reader" in graph["lean_qwenflash.runtime"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
