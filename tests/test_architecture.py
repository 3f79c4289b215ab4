"""The package's import rules (docs/architecture.md), checked on every module.

Pure static checks (no torch, no ranks): each module's imports of the package, top-level and
inside functions, against the layer table and the rules inside a layer (the harness's two
sides, no claim importing another, the named forbidden edges); absolute imports only; each
folder a regular package with its modules; the layer table of docs/architecture.md names every
module, in its layer here; private torch access only in ``_compat.py``; no reference to a file
outside the repository. The one import-rule test that needs a subprocess
(``compare`` and the reports load no torch) is in tests/test_gate_layout.py.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping

import pytest
from package_imports import file_imports, module_imports, package_imports, relative_imports

pytestmark = pytest.mark.cpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsdp_conformance"

#: Layer of each top-level module or folder (docs/architecture.md, "the layers"). The blocks
#: are three wings, each a folder named for its job: ``models`` (what is sharded: the model, its
#: blocks, the policies and the unit plans), ``fsdp`` (applying FSDP and reading what it holds),
#: ``measure`` (what a step costs). ``hf_models`` stays at the top, where users type its path.
LAYERS: dict[str, str] = {
    "__init__": "base",
    "_compat": "base",
    "_files": "base",
    "sizes": "base",
    "settings": "base",
    "expectations": "base",
    "harness": "harness",
    "models": "models",
    "hf_models": "models",
    "fsdp": "fsdp",
    "measure": "measure",
    "plan": "plan",
    "claims": "claims",
    "gate": "gate",
    "cli": "wiring",
    "cli_parser": "wiring",
    "plugin": "wiring",
    "model_tests": "wiring",
}

#: What each layer may import from the package (its own layer included).
ALLOWED: dict[str, set[str]] = {
    "base": {"base"},
    "harness": {"base", "harness"},
    "models": {"base", "models"},
    "fsdp": {"base", "harness", "models", "fsdp"},
    "measure": {"base", "harness", "models", "fsdp", "measure"},
    "plan": {"base", "models", "fsdp", "measure", "plan"},
    "claims": {"base", "harness", "models", "fsdp", "measure", "plan", "claims"},
    "gate": {"base", "harness", "models", "fsdp", "measure", "claims", "gate"},
    "wiring": {
        "base",
        "harness",
        "models",
        "fsdp",
        "measure",
        "plan",
        "claims",
        "gate",
        "wiring",
    },
}

#: Rules inside a layer: for each module listed, the only modules of its own layer it may
#: import. The harness's rank side (``worker``, ``clean_state``) and parent side (``pool``,
#: ``forkserver``, ``launcher``, ``outcomes``) share only ``protocol``; the pool and the fork
#: server start the worker by its module name (docs/harness.md). A module not listed
#: (``harness.ranks``, the ``harness`` package itself) may import its whole layer. Importing
#: ``fsdp_conformance.harness`` is importing every module of the folder (its ``__init__`` does).
WITHIN_LAYER_ONLY: dict[str, set[str]] = {
    "harness.protocol": set(),
    "harness.interrupts": set(),
    "harness.clean_state": {"harness.protocol"},
    "harness.worker": {"harness.protocol", "harness.clean_state"},
    "harness.outcomes": {"harness.protocol"},
    "harness.forkserver": {"harness.outcomes"},
    "harness.timeouts": set(),
    "harness.engine": {"harness.protocol"},
    "harness.pool": {
        "harness.protocol",
        "harness.outcomes",
        "harness.forkserver",
        "harness.timeouts",
    },
    "harness.manager": {
        "harness.protocol",
        "harness.engine",
        "harness.outcomes",
        "harness.forkserver",
        "harness.timeouts",
        "harness.pool",
    },
    "harness.launcher": {
        "harness.protocol",
        "harness.engine",
        "harness.outcomes",
        "harness.timeouts",
        "harness.worker",
        "harness.interrupts",
    },
    "harness.supervisor": {
        "harness.protocol",
        "harness.engine",
        "harness.outcomes",
        "harness.forkserver",
        "harness.timeouts",
        "harness.pool",
        "harness.launcher",
    },
    "harness.session": {
        "harness.supervisor",
        "harness.protocol",
        "harness.engine",
        "harness.outcomes",
        "harness.interrupts",
        "harness.forkserver",
        "harness.timeouts",
        "harness.pool",
        "harness.manager",
        "harness.launcher",
    },
}

#: Imports the layer table allows but a module must not make, each with the reason.
NEVER: dict[str, dict[str, str]] = {
    "models.policies": {
        "models.model_spec": "model_spec imports policies (SEED_MIN_PARAMS, block-class resolution); "
        "the way back would close an import cycle through the seeds' threshold"
    },
    "model_tests": {
        "plugin": "wiring importing wiring: the plugin parametrizes "
        "conformance_check, model_tests.py holds only the test"
    },
}

#: The modules each folder of the package holds (the diagram in docs/architecture.md); a claim
#: that is a folder of check families is a folder of its own here (``claims/state``).
FOLDERS: dict[str, set[str]] = {
    "harness": {
        "protocol",
        "engine",
        "outcomes",
        "timeouts",
        "pool",
        "manager",
        "forkserver",
        "launcher",
        "ranks",
        "session",
        "worker",
        "clean_state",
        "interrupts",
    },
    "models": {
        "model_spec",
        "reference_models",
        "llama",
        "catalog",
        "block_classes",
        "policies",
        "units",
        "user_model",
        "hf",
    },
    "fsdp": {
        "sharding",
        "meta_init",
        "meta_materialize",
        "state_dict_kinds",
        "collectives",
        "reference_step",
        "determinism",
        "tensors",
        "torch_errors",
        "capabilities",
        "model_init",
        "distributions",
    },
    "measure": {"meters", "timeline", "step", "bound", "profile", "scaling"},
    "claims": {"check", "faults"},
    "claims/defaults": {"common", "fingerprint", "state_dict"},
    "claims/memory": {
        "common",
        "peak_within_bound",
        "sawtooth",
        "depth_invariance",
        "meter_agrees",
        "mixed_precision_peak",
        "plan_estimate_matches",
    },
    "claims/wrap": {"common", "units", "builders", "train", "mixed", "prefetch"},
    "claims/init": {
        "common",
        "meta_build",
        "faithful",
        "weights",
        "seeds",
        "broadcast",
        "train_step",
        "peak_memory",
    },
    "claims/state": {
        "common",
        "round_trip",
        "resume",
        "dcp",
        "reshard",
        "checkpoint",
        "across_versions",
        "shared_step",
        "summon",
    },
    "claims/loop": {
        "common",
        "accumulation",
        "clipping",
        "frozen",
        "ignored",
        "entry_points",
        "uneven",
        "buffers",
    },
    "claims/stack": {"common", "reshard", "loss_scaling", "meshes", "compile", "checkpointing"},
    "plan": {"model", "activations", "estimate", "verify", "report"},
    "gate": {
        "suite",
        "outputs",
        "report",
        "schema",
        "tables",
        "compare",
        "difference",
        "figures",
        "structure",
        "new_warnings",
        "verdict",
        "noise",
        "matrix",
        "migrate",
        "plots",
    },
}

#: The most lines a module may have: past it a module holds more than one idea; split
#: it by idea, each part named for what it holds, its callers importing from the part.
MAX_MODULE_LINES = 700
#: Modules still over the limit, each with why. An entry goes when its module is split (the
#: test below fails on an entry whose module is within the limit).
OVER_THE_LIMIT: dict[str, str] = {}

#: Private torch access: a ``._name`` step in a dotted torch path, FSDP1's handle, storage
#: identity and view internals. Allowed only in ``_compat.py``.
PRIVATE_TORCH = re.compile(
    r"torch(?:\.\w+)*\._[a-z]\w*|\._handle\b|\._cdata\b|\._is_view\(|\._use_count\("
)


def _modules() -> list[tuple[str, pathlib.Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found.append((".".join(parts), path))
    return found


def _layer(dotted: str) -> str:
    """The layer of ``fsdp_conformance.x.y`` (or of a module name relative to the package)."""
    head = dotted.removeprefix("fsdp_conformance").lstrip(".").split(".")[0] or "__init__"
    if head == "__version__":  # `from fsdp_conformance import __version__`
        head = "__init__"
    if head not in LAYERS:
        raise AssertionError(
            f"module {dotted!r} is in no layer: add it to LAYERS here and to the table in "
            "docs/architecture.md"
        )
    return LAYERS[head]


def _violations(name: str, imported: set[str]) -> list[str]:
    layer = _layer(name)
    bad = []
    for target in sorted(imported):
        target_layer = _layer(target)
        if target_layer not in ALLOWED[layer]:
            bad.append(f"{name} ({layer}) imports {target} ({target_layer})")
    return bad


def test_every_module_belongs_to_a_layer() -> None:
    for name, _ in _modules():
        _layer(name)


def _layer_table(text: str) -> dict[str, str]:
    """The layer table of docs/architecture.md: each name its rows give (a module, or a folder as
    ``folder/*``), backticked in the modules cell and outside parentheses, -> the row's layer."""
    table: dict[str, str] = {}
    lines = iter(text.splitlines())
    for line in lines:
        if re.match(r"\|\s*layer\s*\|\s*modules\s*\|", line):
            break
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= set("-: "):
            continue
        for name in re.findall(r"`([^`]+)`", re.sub(r"\([^()]*\)", "", cells[1])):
            table[name] = cells[0]
    return table


def _table_names(module: str, folders: set[str]) -> tuple[str, ...]:
    """The names of the layer table that cover ``module`` (dotted, relative to the package)."""
    head, *rest = module.split(".")
    if head in folders:
        return (f"{head}/*", *(f"{head}/{r}" for r in rest[:1]))
    return (head,)


def _table_mismatches(
    table: dict[str, str], modules: list[str], folders: set[str], layers: dict[str, str]
) -> list[str]:
    """Modules no row names, modules in another layer than ``layers`` says, rows naming none."""
    bad = []
    for module in modules:
        names = [n for n in _table_names(module, folders) if n in table]
        if not names:
            bad.append(f"{module} is in no row of the layer table")
        elif table[names[0]] != layers[module.split(".")[0]]:
            bad.append(
                f"{module} is in the {table[names[0]]} row; its layer is "
                f"{layers[module.split('.')[0]]}"
            )
    covered = {n for m in modules for n in _table_names(m, folders)}
    bad += [
        f"the layer table names {name}, no module of the package"
        for name in table
        if name not in covered
    ]
    return bad


def test_the_layer_table_in_the_docs_names_every_module_in_its_layer() -> None:
    table = _layer_table((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert table, "docs/architecture.md has no | layer | modules | table"
    modules = [name for name, _ in _modules() if name != "__init__"]
    bad = _table_mismatches(table, modules, set(FOLDERS), LAYERS)
    assert not bad, "docs/architecture.md's layer table and the package disagree:\n" + (
        "\n".join(bad)
    )


def test_the_layer_table_check_catches_a_module_missing_from_it() -> None:
    # Negative control: a table with a module left out (and one folder, a stale name) reports
    # each; a parenthesized file name and the header are not module names.
    text = (
        "Before the table, `cli` in prose.\n\n"
        "| layer | modules | may import from the package |\n"
        "|---|---|---|\n"
        "| base | `sizes`, `settings` (options, read from `x.toml`), `gone` | nothing |\n"
        "| harness | `harness/*` | base |\n"
        "\nAfter it, `plugin`.\n"
    )
    table = _layer_table(text)
    assert table == {"sizes": "base", "settings": "base", "gone": "base", "harness/*": "harness"}
    modules = ["sizes", "settings", "harness", "harness.pool", "claims.wrap"]
    layers = {"sizes": "base", "settings": "base", "harness": "harness", "claims": "claims"}
    folders = {"harness", "claims"}
    assert _table_mismatches(table, modules[:-1], folders, layers) == [
        "the layer table names gone, no module of the package"
    ]
    assert _table_mismatches(table, modules, folders, layers) == [
        "claims.wrap is in no row of the layer table",
        "the layer table names gone, no module of the package",
    ]
    without = _layer_table(text.replace("`sizes`, ", ""))
    assert _table_mismatches(without, modules[:-1], folders, layers) == [
        "sizes is in no row of the layer table",
        "the layer table names gone, no module of the package",
    ]
    moved = _layer_table(text.replace("| base |", "| blocks |"))
    assert _table_mismatches(moved, modules[:1], folders, layers)[0] == (
        "sizes is in the blocks row; its layer is base"
    )


def test_each_layer_imports_only_the_layers_below_it() -> None:
    bad = [v for name, path in _modules() for v in _violations(name, file_imports(path))]
    assert not bad, "import rule broken (docs/architecture.md):\n" + "\n".join(bad)


def test_the_rule_catches_a_harness_that_imports_a_claim() -> None:
    # Negative control: the checker itself must flag the layering the docs forbid.
    assert _violations("harness.pool", {"fsdp_conformance.claims.memory"}) == [
        "harness.pool (harness) imports fsdp_conformance.claims.memory (claims)"
    ]
    assert _violations("claims.wrap", {"fsdp_conformance.cli"})
    assert _violations("plan.estimate", {"fsdp_conformance.harness"})
    assert not _violations(
        "claims.wrap", {"fsdp_conformance.measure.step", "fsdp_conformance.harness"}
    )


def test_no_claim_imports_another_claim() -> None:
    bad = []
    for name, path in _modules():
        if not name.startswith("claims.") or name == "claims.check":
            continue
        own = name.split(".")[1]
        for target in file_imports(path):
            parts = target.removeprefix("fsdp_conformance.").split(".")
            if parts[0] == "claims" and len(parts) > 1 and parts[1] not in ("check", "faults", own):
                bad.append(f"{name} imports {'.'.join(parts[:2])}")
    assert not bad, "a claim imports another claim; move the shared code to a block:\n" + (
        "\n".join(bad)
    )


#: The claims that are folders of check families (every claim, since each has two or more).
CLAIM_FOLDERS = sorted(f.removeprefix("claims/") for f in FOLDERS if f.startswith("claims/"))


def _claim_plan_problems(claim: str, sources: Mapping[str, str]) -> list[str]:
    """What in one claim folder (module name -> source) breaks the plan every claim folder has
    (docs/architecture.md, "A new claim"): ``__init__.py`` (the ``CHECKS`` chain), ``common.py``
    (what its families share) and one module per family; a family imports, of its own claim,
    only ``common`` (top-level or inside a function), and ``common`` imports no family."""
    problems = [
        f"claims/{claim}/ has no {required}.py"
        for required in ("__init__", "common")
        if required not in sources
    ]
    families = sorted(set(sources) - {"__init__", "common"})
    if not families:
        problems.append(f"claims/{claim}/ has no family module")
    prefix = f"fsdp_conformance.claims.{claim}."
    for name in ("common", *families):
        if name not in sources:
            continue
        own = {
            target.removeprefix(prefix).split(".")[0]
            for target in package_imports(sources[name])
            if target.startswith(prefix)
        }
        allowed = {"common"} if name != "common" else set()
        problems += [
            f"claims/{claim}/{name}.py imports claims/{claim}/{other}.py; a family imports "
            "only its claim's common.py"
            for other in sorted((own & set(sources)) - allowed - {name})
        ]
    return problems


def test_every_claim_folder_has_the_same_plan() -> None:
    assert CLAIM_FOLDERS, "no claim folder in FOLDERS"
    bad = []
    for claim in CLAIM_FOLDERS:
        folder = PACKAGE / "claims" / claim
        sources = {p.stem: p.read_text(encoding="utf-8") for p in folder.glob("*.py")}
        bad += _claim_plan_problems(claim, sources)
    assert not bad, "a claim folder breaks the plan (docs/architecture.md):\n" + "\n".join(bad)


def test_the_claim_plan_check_catches_a_family_importing_another() -> None:
    # Negative control: a folder without common.py, whose family imports another family inside
    # a function, and a common.py that imports a family, are each caught; the plan is not.
    good = {
        "__init__": "from fsdp_conformance.claims.x.a import rank_a\n",
        "common": "from fsdp_conformance.claims.check import Verdict\n",
        "a": "from fsdp_conformance.claims.x.common import Verdict\n",
        "b": "from fsdp_conformance.claims.x import common\n",
    }
    assert _claim_plan_problems("x", good) == []
    sneaky = {**good, "b": "def f():\n    from fsdp_conformance.claims.x.a import rank_a\n"}
    assert _claim_plan_problems("x", sneaky) == [
        "claims/x/b.py imports claims/x/a.py; a family imports only its claim's common.py"
    ]
    no_common = {k: v for k, v in good.items() if k != "common"}
    assert _claim_plan_problems("x", no_common) == ["claims/x/ has no common.py"]
    back = {**good, "common": "from fsdp_conformance.claims.x import b\n"}
    assert _claim_plan_problems("x", back) == [
        "claims/x/common.py imports claims/x/b.py; a family imports only its claim's common.py"
    ]
    assert _claim_plan_problems("x", {"__init__": "", "common": ""}) == [
        "claims/x/ has no family module"
    ]


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The cycles of an import graph (module -> the modules it imports): each strongly connected
    component of two or more modules, or a module importing itself, sorted (Tarjan's
    algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return sorted(found)


def _package_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports, at module level and
    inside functions (:func:`package_imports.module_imports`: a package is its ``__init__``)."""
    graph = {}
    for name, path in _modules():
        dotted = "fsdp_conformance" if name == "__init__" else f"fsdp_conformance.{name}"
        targets = module_imports(path.read_text(encoding="utf-8"), PACKAGE)
        graph[dotted] = {t for t in targets if t != dotted}
    return graph


def test_the_package_has_no_import_cycle() -> None:
    # Function-level imports count: an import inside a function that closes a cycle is how the
    # state claim's faults module and its families imported each other.
    cycles = import_cycles(_package_graph())
    assert not cycles, "import cycles (break each: shared code goes to a common module):\n" + (
        "\n".join(" <-> ".join(c) for c in cycles)
    )


def test_the_cycle_check_catches_a_cycle() -> None:
    # Negative control: a synthetic graph with a three-module cycle (and a self-import) is
    # caught; a chain and a diamond are not cycles.
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"b", "c"}}) == []
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"a"}, "b": set()}) == [["a"]]
    # The old state claim, written as it was: the faults module importing a family inside a
    # function, the family importing the faults module.
    faults = "def effect():\n    from fsdp_conformance.claims.state import round_trip\n"
    family = "from fsdp_conformance.claims.state.faults import FAULTS\n"
    graph = {
        "faults": {m.rsplit(".", 1)[-1] for m in package_imports(faults) if "state." in m},
        "round_trip": {m.rsplit(".", 1)[-1] for m in package_imports(family) if "state." in m},
    }
    assert import_cycles(graph) == [["faults", "round_trip"]]


def _short(dotted: str) -> str:
    return dotted.removeprefix("fsdp_conformance").lstrip(".") or "__init__"


def _within_layer_violations(name: str, imported: set[str]) -> list[str]:
    """What ``name`` imports (``module_imports``' names) against WITHIN_LAYER_ONLY and NEVER."""
    bad = []
    for target in sorted(_short(t) for t in imported):
        if name in WITHIN_LAYER_ONLY and target != name and _layer(target) == _layer(name):
            allowed = WITHIN_LAYER_ONLY[name]
            if target not in allowed:
                bad.append(
                    f"{name} imports {target}; of its layer it may import only "
                    f"{', '.join(sorted(allowed)) or 'nothing'}"
                )
        for forbidden, why in NEVER.get(name, {}).items():
            if target == forbidden or target.startswith(forbidden + "."):
                bad.append(f"{name} imports {target}: {why}")
    return bad


def test_the_rules_inside_a_layer_hold() -> None:
    bad = [
        v
        for name, path in _modules()
        for v in _within_layer_violations(
            name, module_imports(path.read_text(encoding="utf-8"), PACKAGE)
        )
    ]
    assert not bad, "import rule inside a layer broken (docs/architecture.md):\n" + ("\n".join(bad))


def test_the_rules_inside_a_layer_catch_the_edges_they_forbid() -> None:
    # Negative controls: the rank side importing the parent side, written into the worker
    # inside a function body, is caught (the package import as well as the parent-side module);
    # so are the named edges, and a plain allowed import is not.
    worker = (PACKAGE / "harness" / "worker.py").read_text(encoding="utf-8") + (
        "\ndef _sneak():\n"
        "    from fsdp_conformance.harness.pool import RankPool\n"
        "    from fsdp_conformance.harness import Ranks\n"
        "    return RankPool, Ranks\n"
    )
    assert [
        v.split(";")[0]
        for v in _within_layer_violations("harness.worker", module_imports(worker, PACKAGE))
    ] == ["harness.worker imports harness", "harness.worker imports harness.pool"]
    assert _within_layer_violations(
        "models.policies",
        module_imports("from fsdp_conformance.models.model_spec import ModelSpec", PACKAGE),
    )
    plugin_back = "def f(m):\n    from fsdp_conformance.plugin import SETTINGS_KEY\n"
    assert _within_layer_violations("model_tests", module_imports(plugin_back, PACKAGE)) == [
        f"model_tests imports plugin: {NEVER['model_tests']['plugin']}"
    ]
    assert not _within_layer_violations(
        "harness.pool",
        module_imports("from fsdp_conformance.harness import outcomes, protocol", PACKAGE),
    )


def test_the_package_uses_absolute_imports_only() -> None:
    # The readers of the import graph see absolute imports only; a relative one
    # (`from ..cli import main` in the planner) would slip past every rule above.
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for _, path in _modules()
        for line in relative_imports(path.read_text(encoding="utf-8"))
    ]
    assert not bad, "relative imports (write fsdp_conformance.x):\n" + "\n".join(bad)
    assert relative_imports("import os\ndef f():\n    from ..cli import main\n") == [3]


def test_each_folder_is_a_regular_package_with_its_modules() -> None:
    # A regular package, not a namespace one: setuptools' find() ships only those.
    folders = {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*/*.py")}
    assert folders == set(FOLDERS), "add the folder to FOLDERS here and to docs/architecture.md"
    for folder, modules in FOLDERS.items():
        found = {p.stem for p in (PACKAGE / folder).glob("*.py")}
        assert "__init__" in found, folder
        assert modules <= found, f"{folder}/ lacks {sorted(modules - found)}"


def _over_the_limit(modules: list[tuple[str, str]], limit: int = MAX_MODULE_LINES) -> list[str]:
    """Each module (name, text) longer than ``limit`` lines, with its length."""
    return [
        f"{name}: {len(text.splitlines())} lines"
        for name, text in modules
        if len(text.splitlines()) > limit
    ]


def test_no_module_is_over_700_lines() -> None:
    modules = [(name, path.read_text(encoding="utf-8")) for name, path in _modules()]
    over = _over_the_limit(modules)
    bad = [line for line in over if line.split(":")[0] not in OVER_THE_LIMIT]
    assert not bad, f"modules over {MAX_MODULE_LINES} lines (split each by idea):\n" + "\n".join(
        bad
    )
    stale = sorted(set(OVER_THE_LIMIT) - {line.split(":")[0] for line in over})
    assert not stale, f"within the limit now, remove from OVER_THE_LIMIT: {stale}"


def test_the_length_check_flags_a_701_line_module() -> None:
    # Negative control: one line past the limit is flagged, the limit itself is not.
    assert _over_the_limit([("x", "pass\n" * 701), ("y", "pass\n" * 700)]) == ["x: 701 lines"]


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """Source lines without comments (private names in prose are fine)."""
    return [
        (i, line.split("#", 1)[0])
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
    ]


def test_private_torch_access_only_in_compat() -> None:
    bad = []
    for name, path in _modules():
        if name == "_compat":
            continue
        for lineno, code in _code_lines(path):
            if PRIVATE_TORCH.search(code):
                bad.append(f"{path.relative_to(ROOT)}:{lineno}: {code.strip()}")
    assert not bad, "private torch access outside _compat.py:\n" + "\n".join(bad)


def test_the_private_access_pattern_catches_the_usual_forms() -> None:
    for code in (
        "from torch.utils._pytree import tree_map",
        "m._handle.flat_param",
        "torch.distributed.fsdp._init_utils",
        "t.untyped_storage()._cdata",
    ):
        assert PRIVATE_TORCH.search(code), code
    for code in ("import torch.distributed as dist", "torch.nn.init.zeros_(w)", "self._ranks"):
        assert not PRIVATE_TORCH.search(code), code


def test_nothing_cites_a_file_outside_the_repository() -> None:
    # Facts the code relies on live in docs/ (CI and users do not have the team's notes).
    files = [p for p in (ROOT / "fsdp_conformance").rglob("*.py")]
    files += [p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_architecture.py"]
    files += list((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    bad = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if "NOTES.md" in line or "shared/seeds" in line
    ]
    assert not bad, "references to files outside the repository:\n" + "\n".join(bad)
