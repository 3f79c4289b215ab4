"""One reader of the package's import graph, for the tests that enforce its layering.

Not a test module (pytest collects ``test_*.py`` only); the tests import it by name, as pytest
puts their folder on ``sys.path``.
"""

from __future__ import annotations

import ast
import pathlib


def package_imports(source: str) -> set[str]:
    """Every ``fsdp_conformance`` name ``source`` imports, at any depth (inside functions too).

    ``from fsdp_conformance.x import y`` gives both ``fsdp_conformance.x`` and
    ``fsdp_conformance.x.y`` (``y`` may be a submodule); ``importlib.import_module("...")``
    with a literal name counts as an import.
    """
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return {n for n in names if n == "fsdp_conformance" or n.startswith("fsdp_conformance.")}


def file_imports(path: pathlib.Path) -> set[str]:
    """:func:`package_imports` of one source file."""
    return package_imports(path.read_text(encoding="utf-8"))
