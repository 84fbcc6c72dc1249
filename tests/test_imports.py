"""Every module of the project imports on its own, first, in a fresh interpreter: an import cycle only
shows when the cycle's other end is imported first (`python -m memory.bench` once failed that way, the
tests all passing because they import the Agent before the embedder)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "cache", "memory", "classifiers")

CHECK = """
import importlib, sys
ours = {packages!r}
failed = []
for name in {modules!r}:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ours or m == "cli"]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(f"{{name}}: {{type(error).__name__}}: {{error}}")
print("\\n".join(failed))
"""


def project_modules() -> list[str]:
    """cli and every module of the packages, subpackages included (found by their files, not imported)."""
    names = ["cli"]
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_imports_first_on_its_own():
    modules = project_modules()
    assert {"memory.embedder", "memory.recall", "agent.packed", "agent.eval.harness", "cache.span"} <= set(modules)
    done = subprocess.run([sys.executable, "-c", CHECK.format(packages=PACKAGES, modules=modules)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ""
