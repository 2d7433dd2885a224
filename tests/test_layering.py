"""Imports point one way: cli/server -> runtime -> generate -> models -> experts -> io, store beside;
families (one file per model family) declare to both the store (key layout) and models (build).

Models never see files (they get weights from an ExpertProvider); the store and the caches never
see models; nothing below the CLI and the server knows about them.
"""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "lean_qwenflash"

# package area -> areas it must not import (anywhere in the file, lazy imports included)
FORBIDDEN = {
    "quant": {"io_engine", "store", "experts", "models", "generate", "runtime", "server", "cli", "chat", "config"},
    "io_engine": {"store", "experts", "models", "generate", "runtime", "server", "cli", "chat", "config"},
    "store": {"models", "generate", "runtime", "server", "cli", "chat", "experts.tiered", "experts.cache"},
    "experts": {"models", "generate", "runtime", "server", "cli", "chat"},
    "models": {"io_engine", "store.reader", "store.packer", "experts.tiered", "experts.cache", "runtime",
               "server", "cli", "chat", "config"},
    "generate": {"io_engine", "store", "experts.tiered", "runtime", "server", "cli", "chat", "config"},
    "chat": {"io_engine", "store", "experts", "models", "generate", "runtime", "server", "cli"},
    # A family file builds its model from models/ and declares its key layout for the store.
    "families": {"io_engine", "store.reader", "store.packer", "experts.tiered", "experts.cache", "runtime",
                 "server", "cli", "chat", "generate", "config"},
    "runtime": {"server", "cli"},
    "server": {"cli"},
}


def _area(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    return rel.parts[0]


def _imports(path: Path) -> set:
    tree = ast.parse(path.read_text())
    pkg_parts = list(path.relative_to(PKG).parent.parts)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod + "." + a.name if not node.module else mod for a in node.names]
            elif node.module and node.module.startswith("lean_qwenflash"):
                names = [node.module[len("lean_qwenflash."):]]
            else:
                continue
            out.update(n.strip(".") for n in names)
        elif isinstance(node, ast.Import):
            out.update(a.name[len("lean_qwenflash."):] for a in node.names if a.name.startswith("lean_qwenflash."))
    return out


def test_imports_point_one_way():
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        area = _area(path)
        for imported in _imports(path):
            for banned in FORBIDDEN.get(area, ()):
                if imported == banned or imported.startswith(banned + "."):
                    problems.append(f"{path.relative_to(PKG)} imports {imported} ({area} must not use {banned})")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_imports():
    assert "experts.provider" in _imports(PKG / "models" / "loader.py")
    assert "store" in _imports(PKG / "runtime.py")
