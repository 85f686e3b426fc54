"""Imports go one way, by layer (docs/architecture.md); no package reads another's files by path; production
code does not use the test support; `import palaestra` stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "palaestra"

LAYER = {
    "trajectories": 1,
    "envs": 2,
    "judges": 2,
    "models": 2,
    "trainer": 3,
    "evals": 3,
}
TOP = 4  # cli, demo, labs, __main__, testing (test support: re-exports) and anything else at the top


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2:
        return TOP  # `palaestra` itself: lazy exports of every layer
    return LAYER.get(parts[1], TOP)


def imports_of(path: Path) -> list[str]:
    """Every absolute palaestra import of a module (function-level ones included)."""
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


# ------------------------------------------------------------------------------------------- path reads
SUBPACKAGES = frozenset(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


def _mentions_file(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(node))


def _climb(node: ast.AST) -> int:
    """How many folders an expression built on ``__file__`` climbs (``.parent`` each, ``.parents[i]`` i + 1)."""
    if isinstance(node, ast.Attribute):
        return _climb(node.value) + (node.attr == "parent")
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "parents"
        and isinstance(node.slice, ast.Constant)
    ):
        return _climb(node.value.value) + int(node.slice.value) + 1
    if isinstance(node, ast.Call):
        return max([_climb(node.func), *(_climb(a) for a in node.args)], default=0)
    return 0


def path_reads(path: Path, root: Path = PKG) -> list[str]:
    """Places where a module reaches into another palaestra package's files instead of importing it.

    Caught: a path built on ``__file__`` that climbs out of the module's own package (``Path(__file__).parents[1]``
    from ``palaestra/models/x.py``) or joins another package's folder name to it (``... / "envs"``), and
    ``importlib.resources`` / ``files("palaestra.<other>")`` lookups of another package.
    """
    rel = path.relative_to(root)
    own = rel.parts[0] if len(rel.parts) > 1 else ""
    depth = len(rel.parts) - 1  # folders between the module and palaestra/ (0 for top-level modules)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        # climbing 1 gives the module's folder, depth + 1 gives palaestra/ (whence any package's files);
        # further up is the source checkout (git_revision looks for .git there)
        climbs = isinstance(node, (ast.Attribute, ast.Subscript)) and _mentions_file(node)
        if climbs and own and _climb(node) == depth + 1:
            found.append(f"{where}: a path climbing out of palaestra/{own} from __file__")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _mentions_file(node):
            names = {n.value for n in ast.walk(node.right) if isinstance(n, ast.Constant)}
            if any(isinstance(v, str) and v in SUBPACKAGES and v != own for v in names):
                found.append(f"{where}: a path into another package's folder from __file__")
        if isinstance(node, ast.Call):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    parts = arg.value.split(".")
                    fn = node.func
                    name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                    is_resource = name in {
                        "files",
                        "open_text",
                        "open_binary",
                        "read_text",
                        "path",
                        "as_file",
                    }
                    if is_resource and parts[0] == "palaestra" and len(parts) > 1 and parts[1] != own:
                        found.append(f"{where}: importlib.resources lookup of {arg.value}")
    return sorted(set(found))


def test_no_package_reads_another_packages_files_by_path() -> None:
    problems = [p for path in sorted(PKG.rglob("*.py")) for p in path_reads(path)]
    assert problems == []


def test_path_read_scan_catches_the_patterns(tmp_path: Path) -> None:
    """The scan above is only worth something if it sees the ways a module can reach into another package."""
    bad = {
        "models/a.py": 'from pathlib import Path\nD = Path(__file__).resolve().parents[1] / "envs" / "data"\n',
        "models/b.py": "from pathlib import Path\nD = Path(__file__).parent.parent\n",
        "models/c.py": 'import importlib.resources as r\nD = r.files("palaestra.envs")\n',
        "models/hf/d.py": "from pathlib import Path\nD = Path(__file__).parents[2]\n",
    }
    fine = {
        "models/e.py": 'from pathlib import Path\nD = Path(__file__).resolve().parent / "weights"\n',
        "models/hf/f.py": 'from pathlib import Path\nD = Path(__file__).parents[1] / "weights"\n',
        "envs/g.py": 'from pathlib import Path\nD = Path(__file__).parent / "data" / "arithmetic"\n',
    }
    for rel, text in {**bad, **fine}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    flagged = {rel for rel in {**bad, **fine} if path_reads(tmp_path / rel, root=tmp_path)}
    assert flagged == set(bad)


def test_production_code_does_not_import_the_test_support() -> None:
    users = [
        f"{path.relative_to(PKG.parent)} imports {imp}"
        for path in sorted(PKG.rglob("*.py"))
        if path.relative_to(PKG).parts[0] != "testing"
        for imp in imports_of(path)
        if imp == "palaestra.testing" or imp.startswith("palaestra.testing.")
    ]
    assert users == []
