"""docs/architecture.md stays true: one line per module, and the layer diagram equals the imports.

Parses every module's imports (function-level ones included) and checks each cross-layer edge
against the layers the document draws; a new module without its line fails here, not in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "treeverify"
DOC = ROOT / "docs" / "architecture.md"

# layer -> the layers it may import (docs/architecture.md, "Layers"); env is open to all.
ALLOWED = {
    "kernels": set(),
    "models": {"kernels"},
    "spec": {"kernels", "models"},
    "engine": {"kernels", "models", "spec"},
    "server": {"engine", "models", "spec", "kernels"},
    "integrations": {"kernels", "spec"},
    "gate": set(),
}
TOP = {"cli", "__main__", "check", "bench"}  # entry points: may import any layer
SHARED = {"env", "progress", "strict_args"}  # open to every layer; they import nothing of ours


def _layer(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_layers(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "treeverify":
                names = [f"treeverify.{a.name}" for a in node.names if not a.name.startswith("_")]
            else:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "treeverify" and len(parts) > 1:
                out.add(parts[1])
    return out


def test_imports_follow_the_layers():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        layer = _layer(path)
        used = _imported_layers(path) - {layer, "__init__"} - SHARED
        if layer in TOP or layer in SHARED or layer == "__init__":
            if layer in SHARED:
                bad += [f"{path.relative_to(PKG)} -> {u}" for u in used]
            continue
        if "bench" in used:
            bad.append(f"{path.relative_to(PKG)} -> bench (imported by nobody)")
        allowed = ALLOWED.get(layer)
        assert allowed is not None, f"{layer}/: a new layer; add it to the doc and to ALLOWED"
        bad += [f"{path.relative_to(PKG)} -> {u}" for u in sorted(used - allowed)]
    assert not bad, "imports against docs/architecture.md's layers:\n" + "\n".join(bad)


def test_every_module_has_its_line():
    doc = DOC.read_text()
    lines = doc.splitlines()
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if f"treeverify/{rel}" in doc:
            continue
        parent = f"treeverify/{path.parent.relative_to(PKG).as_posix()}/".replace("/./", "/")
        if any(parent in line and f"`{path.name}`" in line for line in lines):
            continue  # a grouped line: `treeverify/dir/a.py`, `b.py`
        missing.append(rel)
    assert not missing, "modules without a line in docs/architecture.md: " + ", ".join(missing)


def test_every_kernel_source_and_script_is_named():
    """The CUDA sources (the jit builds them by name) and the scripts a later session re-runs
    are part of the map too: each named somewhere in the document (two scripts had gone
    missing by the fifty-second session)."""
    doc = DOC.read_text()
    named = sorted(PKG.rglob("*.cu")) + sorted(PKG.rglob("*.cuh"))
    named += sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())
    missing = [p.relative_to(ROOT).as_posix() for p in named if f"{p.name}`" not in doc]
    assert not missing, "without a mention in docs/architecture.md: " + ", ".join(missing)


def test_no_references_outside_the_repository():
    assert "shared/design" not in DOC.read_text(), "docs/architecture.md must stand alone"
