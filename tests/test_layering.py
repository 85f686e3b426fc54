"""Imports go one way, by layer (docs/architecture.md); `import palaestra` stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "palaestra"

LAYER = {
    "trajectories": 1,
    "testing": 1,
    "envs": 2,
    "judges": 2,
    "models": 2,
    "trainer": 3,
    "evals": 3,
}
TOP = 4  # cli, demo, labs, __main__, and anything else at the top


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2:
        return TOP  # `palaestra` itself: lazy exports of every layer
    return LAYER.get(parts[1], TOP)


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return [m for m in found if m == "palaestra" or m.startswith("palaestra.")]


def test_imports_respect_layers() -> None:
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        own = layer_of(module)
        own_pkg = module.split(".")[1] if "." in module else ""
        for imp in imports_of(path):
            target = layer_of(imp)
            target_pkg = imp.split(".")[1] if "." in imp else ""
            if own_pkg == target_pkg or (imp == "palaestra" and own == TOP):
                continue
            if imp == "palaestra" and own < TOP:
                problems.append(f"{module} imports the top-level package (use the layer module)")
            elif target >= own and own < TOP:
                problems.append(f"{module} (layer {own}) imports {imp} (layer {target})")
    assert problems == []


def test_import_palaestra_is_light() -> None:
    code = (
        "import sys, palaestra\n"
        "heavy = [m for m in ('openai', 'fastapi', 'uvicorn', 'matplotlib', 'torch', 'tqdm', 'numpy') "
        "if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""


def test_modules_stay_small() -> None:
    too_long = {}
    for path in PKG.rglob("*.py"):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > 450:
            too_long[str(path.relative_to(PKG))] = n
    assert too_long == {}
