"""One reader of the package's import graph, for the tests that enforce its layering.

Not a test module (pytest collects ``test_*.py`` only); the tests import it by name, as pytest
puts their folder on ``sys.path``.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

PACKAGE = "fsdp_conformance"


def _statements(source: str) -> Iterator[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` of every absolute import in ``source``, at any depth.

    ``import a.b`` gives ``("a.b", ())``, ``from a import b, c`` gives ``("a", ("b", "c"))``,
    ``importlib.import_module("a")`` with a literal name gives ``("a", ())``.
    """
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, tuple(a.name for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, ()


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def package_imports(source: str) -> set[str]:
    """Every ``fsdp_conformance`` name ``source`` imports, at any depth (inside functions too).

    ``from fsdp_conformance.x import y`` gives both ``fsdp_conformance.x`` and
    ``fsdp_conformance.x.y`` (``y`` may be a submodule); ``importlib.import_module("...")``
    with a literal name counts as an import.
    """
    names: set[str] = set()
    for module, froms in _statements(source):
        names.add(module)
        names.update(f"{module}.{name}" for name in froms)
    return {n for n in names if _ours(n)}


def module_imports(source: str, package_dir: pathlib.Path) -> set[str]:
    """The package's modules ``source`` imports, each as the module whose code it runs.

    ``from fsdp_conformance.harness import protocol`` is the submodule
    ``fsdp_conformance.harness.protocol``; ``from fsdp_conformance.harness import Ranks`` is
    the package ``fsdp_conformance.harness`` itself (its ``__init__``). ``package_dir`` is the
    package's folder, where a name is looked up to tell a submodule from an attribute.
    """

    def is_module(dotted: str) -> bool:
        path = package_dir.parent.joinpath(*dotted.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    found: set[str] = set()
    for module, froms in _statements(source):
        if not froms:
            found.add(module)
        for name in froms:
            found.add(f"{module}.{name}" if is_module(f"{module}.{name}") else module)
    return {n for n in found if _ours(n)}


def relative_imports(source: str) -> list[int]:
    """Line numbers of relative imports (``from .x import y``), which the readers above skip."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]


def file_imports(path: pathlib.Path) -> set[str]:
    """:func:`package_imports` of one source file."""
    return package_imports(path.read_text(encoding="utf-8"))
