"""Every module of the package imports on its own, first: no module works only because another
was imported before it (a circle through a package's `__init__` does exactly that)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, pathlib, sys
failed = []
for path in sorted(pathlib.Path("stride").rglob("*.py")):
    if path.name == "__main__.py":
        continue
    name = ".".join(path.with_suffix("").parts).removesuffix(".__init__")
    for loaded in [m for m in sys.modules if m == "stride" or m.startswith("stride.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
"""


def test_every_module_imports_first():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""
