"""The pytest plugin: options, markers, fixtures and the report header. Wiring only.

The work lives in the library: settings in :mod:`fsdp_conformance.settings`, ranks in
:mod:`fsdp_conformance.harness`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from fsdp_conformance.harness import (
    CheckSkipped,
    GpuShare,
    HarnessSession,
    PoolManager,
    RankEngine,
    Ranks,
    lane_unavailable,
    outer_deadline,
    xdist_share,
)
from fsdp_conformance.settings import (
    OPTIONS,
    Settings,
    SettingsError,
    WorldSizeLimit,
    pyproject_settings,
    resolve_settings,
    world_size_limit,
)

if TYPE_CHECKING:  # the suite imports the claims, hence torch: only where checks are collected
    from fsdp_conformance.gate.suite import SuitePlan

SETTINGS_KEY = pytest.StashKey[Settings]()
#: The session's harness: signals, fork servers, warm pools, the launch (its lifecycle).
HARNESS_KEY = pytest.StashKey[HarnessSession]()
#: ``time.monotonic()`` when a test's setup began (pytest-timeout's clock started just before).
STARTED_KEY = pytest.StashKey[float]()
#: Set on a test whose timeout marker is the plugin's outer guard, not the user's.
OUTER_GUARD_KEY = pytest.StashKey[bool]()
LIMIT_KEY = pytest.StashKey["WorldSizeLimit | None"]()
#: The preflight's notes on the user's model (one line each), for the header.
NOTES_KEY = pytest.StashKey[list[str]]()
#: The session's suite plan (:func:`suite_plan`): made once, read by every parametrization.
PLAN_KEY = pytest.StashKey["SuitePlan"]()
#: The module of the conformance checks as pytest tests, and its file (beside this one; read by
#: path: importing it imports the claims, hence torch, which a session collects only with them).
MODEL_TESTS = "fsdp_conformance.model_tests"
MODEL_TESTS_PATH = Path(__file__).with_name("model_tests.py").resolve()


LANES = ("cpu", "gpu")
#: The marker of tests that start processes of their own or run the whole suite (their own lane,
#: never `-m cpu`).
PROCESS = "process"
MARKERS = (
    "cpu: runs on gloo on any machine (the CPU lane; `pytest -m cpu`)",
    "gpu: needs CUDA and NCCL, one device per rank (the GPU lane; `pytest -m gpu`); skipped with "
    "the reason where the machine has too few devices",
    "process: starts processes of its own (a pytest session, a CLI run, a torchrun launch, a "
    "script, a fork server) or runs the whole suite on a model: the process lane "
    "(`pytest -m process`), not part of `-m cpu`",
    "world_size(*sizes): run this test once per world size (e.g. world_size(2, 4)); without it, "
    "the --fsdp-world-sizes setting applies",
)
#: The outer guard (pytest-timeout) on a test that uses ranks: several checks' worth.
OUTER_TIMEOUT_CHECKS = 5
OUTER_TIMEOUT_MARGIN_S = 60


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp-conformance", "FSDP conformance suite")
    for option in OPTIONS:
        help_text = f"{option.help} [env {option.env}, ini {option.ini}]"
        group.addoption(
            option.flag, dest=option.dest, default=None, metavar=option.metavar, help=help_text
        )
        parser.addini(option.ini, help=option.help, default=None)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    cli = {o.name: config.getoption(o.dest) for o in OPTIONS}
    try:
        table = pyproject_settings(str(config.rootpath))
        ini = {o.name: config.getini(o.ini) for o in OPTIONS}
        settings = config.stash[SETTINGS_KEY] = resolve_settings(cli, os.environ, ini, table)
    except SettingsError as exc:
        raise pytest.UsageError(str(exc)) from None
    # SIGTERM (timeout, CI cancellation) as an interrupt, so the session tears down and the
    # rank pools close; left alone if someone already handles SIGTERM. pytest_unconfigure
    # closes it.
    config.stash[HARNESS_KEY] = HarnessSession(
        check_timeout=settings.timeout, signals=(signal.SIGTERM,), only_default=True
    ).open()
    config.stash[LIMIT_KEY] = world_size_limit(settings, os.environ)  # for world_size markers
    if settings.model:
        config.stash[NOTES_KEY] = _validate_user_model(suite_plan(config))


def _model_tests_module(parent: pytest.Collector, path: Path) -> pytest.Module:
    """model_tests.py as a module node whose id has a file part: its path relative to the
    rootdir, else ``fsdp_conformance/model_tests.py`` (pytest's own id for a file outside the
    rootdir given as an argument, or by ``--pyargs``, is empty: ``::test_conformance[...]``)."""
    try:
        nodeid = path.resolve().relative_to(parent.config.rootpath.resolve()).as_posix()
    except ValueError:
        nodeid = f"{MODEL_TESTS.replace('.', '/')}.py"
    return pytest.Module.from_parent(parent, path=path, nodeid=nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    """model_tests.py collected by pytest itself (its path or ``--pyargs`` given): its node
    ids get their file part too."""
    if module_path.resolve() != MODEL_TESTS_PATH:
        return None
    return _model_tests_module(parent, module_path)


def _model_test_items(session: pytest.Session, items: list[pytest.Item]) -> list[pytest.Item]:
    """With --fsdp-model, the conformance checks (model_tests.py's one test, parametrized):
    collected here, from whatever folder pytest runs in, never as a path argument (a path
    inside a folder pytest also collects, such as an editable clone of this suite, is not
    collected again from its argument). None where the session collected that module itself
    (its path given, or ``--pyargs fsdp_conformance.model_tests``)."""
    path = MODEL_TESTS_PATH
    if any(Path(item.path).resolve() == path for item in items):
        return []
    return list(session.genitems(_model_tests_module(session, path)))


def suite_plan(config: pytest.Config) -> SuitePlan:
    """The session's suite plan (the user's model, the selected checks and their parameters),
    made on first use and kept in ``config.stash``: in ``pytest_configure`` with
    ``--fsdp-model`` (its preflight reads it), else when ``model_tests.py`` is first
    parametrized; a session without the checks never imports them (nor torch)."""
    plan = config.stash.get(PLAN_KEY, None)
    if plan is None:
        from fsdp_conformance.gate.suite import plan_suite  # the claims: only where needed

        plan = config.stash[PLAN_KEY] = plan_suite(config.stash[SETTINGS_KEY], LANES)
    return plan


def _validate_user_model(plan: SuitePlan) -> list[str]:
    """The preflight on the plan's user model: bad --fsdp-model input is one usage error
    naming the problem and the fix; the notes the session goes on with, for the header."""
    from fsdp_conformance.models.model_spec import ModelSpecError
    from fsdp_conformance.models.policies import PolicyError
    from fsdp_conformance.models.user_model import init_contract_problem, validate_user_model

    if plan.spec is None:
        return []
    try:
        # Tests are deselected after this runs (-k): a model without an init contract is a
        # note in the header, not a usage error (the CLI refuses it when init checks run).
        notes = validate_user_model(plan.spec, ["cpu"], plan.world_sizes, init_checks=False)
    except (ModelSpecError, PolicyError) as exc:
        raise pytest.UsageError(f"--fsdp-model: {exc}") from None
    problem = init_contract_problem(plan.spec, plan.spec.build("meta"))
    return notes + ([problem] if problem else [])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    harness = session.config.stash.get(HARNESS_KEY, None)
    if harness is None:
        return
    code = harness.finish(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED)
    if code is not None:
        session.exitstatus = code  # 143: what SIGTERM conventionally is


def gpu_share(config: pytest.Config) -> GpuShare:
    """The CUDA devices this session's pools may use: a pytest-xdist worker's own slice
    (``config.workerinput``'s ``workerid`` of ``workercount``, else
    ``PYTEST_XDIST_WORKER_COUNT``), so that ``pytest -n N`` workers never share a GPU; every
    device outside xdist (an in-process inner session too: it has no ``workerinput``)."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or "workerid" not in workerinput:
        return GpuShare()
    count = workerinput.get("workercount") or os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1
    return xdist_share(workerinput["workerid"], count)


def pytest_unconfigure(config: pytest.Config) -> None:
    harness = config.stash.get(HARNESS_KEY, None)
    if harness is not None:
        harness.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    from fsdp_conformance.gate.report import environment_summary

    settings = config.stash[SETTINGS_KEY]
    notes = [f"fsdp-conformance: note: {n}" for n in config.stash.get(NOTES_KEY, [])]
    return [f"fsdp-conformance: {environment_summary(settings)}", *notes]


def _world_sizes(
    metafunc: pytest.Metafunc, settings: Settings, limit: WorldSizeLimit | None
) -> tuple[int, ...]:
    marker = metafunc.definition.get_closest_marker("world_size")
    if marker is None:
        return settings.world_sizes
    if not marker.args or any(not isinstance(n, int) or n < 1 for n in marker.args):
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: world_size marker takes positive integers, got "
            f"{marker.args!r}; write e.g. @pytest.mark.world_size(2, 4)"
        )
    if limit is not None:
        for size in marker.args:
            message = limit.error(size, f"the world_size marker of {metafunc.definition.nodeid}")
            if message:
                raise pytest.UsageError(message)
    return tuple(marker.args)


def _parametrize_conformance_checks(metafunc: pytest.Metafunc) -> None:
    """model_tests.py's one test, once per selected check and variant of the session's plan
    (the CLI's ``--list`` labels): the reference suite, or every model check on the user's
    model."""
    from fsdp_conformance.gate.suite import check_label

    pairs = suite_plan(metafunc.config).selected
    ids = [check_label(check, params) for check, params in pairs]
    metafunc.parametrize("conformance_check", pairs, ids=ids)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    settings = metafunc.config.stash[SETTINGS_KEY]
    if "conformance_check" in metafunc.fixturenames:  # first: its label leads the test id
        _parametrize_conformance_checks(metafunc)
    if "world_size" in metafunc.fixturenames:
        sizes = _world_sizes(metafunc, settings, metafunc.config.stash.get(LIMIT_KEY, None))
        metafunc.parametrize("world_size", sizes, ids=[f"ws{n}" for n in sizes])
    if "lane" in metafunc.fixturenames:
        marked = [lane for lane in LANES if metafunc.definition.get_closest_marker(lane)]
        if not marked and metafunc.definition.get_closest_marker(PROCESS):
            # The process lane's ranks are gloo ranks; the test stays out of `-m cpu`.
            metafunc.parametrize("lane", [pytest.param("cpu", id="cpu")])
            return
        lanes = marked or list(LANES)  # unmarked: both lanes, each carrying its marker
        metafunc.parametrize(
            "lane",
            [pytest.param(lane, marks=getattr(pytest.mark, lane), id=lane) for lane in lanes],
        )


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the added tests carry lane markers too
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    settings = config.stash[SETTINGS_KEY]
    outer = settings.timeout * OUTER_TIMEOUT_CHECKS + OUTER_TIMEOUT_MARGIN_S
    if settings.model:
        items += _model_test_items(session, items)
    _refuse_process_tests_marked_cpu(items)
    for item in items:
        if not any(item.get_closest_marker(lane) for lane in (*LANES, PROCESS)):
            item.add_marker(pytest.mark.cpu)  # needs no GPU: part of the CPU lane
        uses_ranks = "ranks" in getattr(item, "fixturenames", ())
        if uses_ranks and _pytest_timeout(item) is None and _timeout_plugin_active(config):
            # No pytest-timeout was asked for (a user's --timeout or marker wins): add the
            # outer guard. Either way each check's timeout fits inside it (see `ranks`).
            item.add_marker(pytest.mark.timeout(outer, method="signal"))
            item.stash[OUTER_GUARD_KEY] = True


def _refuse_process_tests_marked_cpu(items: list[pytest.Item]) -> None:
    """A test marked ``process`` that also carries ``cpu`` (usually a module's ``pytestmark``)
    would run in both lanes: a usage error naming them and the fix. (``process`` with ``gpu`` is
    a GPU test that starts processes: it stays in the GPU lane.)"""
    both = [
        item.nodeid
        for item in items
        if item.get_closest_marker(PROCESS) and item.get_closest_marker("cpu")
    ]
    if both:
        shown = ", ".join(both[:3]) + (f" and {len(both) - 3} more" if len(both) > 3 else "")
        raise pytest.UsageError(
            f"{len(both)} test(s) carry both the process and the cpu marker: {shown}. A process "
            "test is not in the CPU lane (`pytest -m process` runs it); remove the cpu marker "
            "from it (a module-level pytestmark included: mark that module's other tests one "
            "by one)"
        )


def _timeout_plugin_active(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("timeout")


def _pytest_timeout(item: pytest.Item) -> tuple[float, str] | None:
    """The pytest-timeout in force for ``item`` and where it was set, or None when it has none.

    The same precedence as pytest-timeout itself: the item's marker, then ``--timeout``, then
    ``PYTEST_TIMEOUT``, then the ini key ``timeout``. 0 means no timeout.
    """
    if not _timeout_plugin_active(item.config):
        return None
    marker = item.get_closest_marker("timeout")
    candidates: list[tuple[object, str]] = []
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        ours = item.stash.get(OUTER_GUARD_KEY, False)
        candidates.append((value, "the plugin's outer guard" if ours else "its timeout marker"))
    candidates += [
        (item.config.getoption("timeout", None), "--timeout"),
        (os.environ.get("PYTEST_TIMEOUT") or None, "PYTEST_TIMEOUT"),
        (item.config.getini("timeout") or None, "ini key timeout"),
    ]
    for value, source in candidates:
        if value is None:
            continue
        try:
            seconds = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None  # pytest-timeout reports its own bad value
        return (seconds, source) if seconds > 0 else None
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # The `ranks` fixture skips its own gpu lane; a gpu test without ranks is skipped here,
    # so that `pytest -m gpu` on a machine without enough devices skips (exit 0), not fails.
    params = getattr(getattr(item, "callspec", None), "params", {})
    lane = params.get("lane")
    if lane is None:
        marked = {name for name in LANES if item.get_closest_marker(name)}
        lane = "gpu" if marked == {"gpu"} else "cpu"
    unavailable = lane_unavailable(lane, params.get("world_size", 1), share=gpu_share(item.config))
    if unavailable:
        pytest.skip(unavailable)
    item.stash[STARTED_KEY] = time.monotonic()


@pytest.fixture(scope="session")
def fsdp_settings(pytestconfig: pytest.Config) -> Settings:
    """The session's resolved settings."""
    return pytestconfig.stash[SETTINGS_KEY]


@pytest.fixture(scope="session")
def rank_pools(pytestconfig: pytest.Config) -> Iterator[PoolManager]:
    """The session's warm rank pools, one per (world size, backend).

    Their process groups' timeout is derived from the session's check timeout
    (``--fsdp-timeout``), so a stuck check is stopped by the harness, with every rank's
    stacks, before a process-group watchdog ends the ranks (:class:`PoolManager`).
    """
    yield pytestconfig.stash[HARNESS_KEY].pools


def _skip(reason: str) -> None:
    pytest.skip(reason)


@pytest.fixture
def ranks(
    request: pytest.FixtureRequest,
    lane: str,
    world_size: int,
    fsdp_settings: Settings,
) -> Ranks:
    """Runs checks on ``world_size`` ranks of this test's lane: ``ranks.run(check, ...)``."""
    # Whether the lane can run here was decided for this test by pytest_runtest_setup.
    # The session's engine: its warm pools (rank_pools), or under torchrun/srun this process's
    # supervisor of its rank of the launch, made by the first test (pytest_sessionfinish ends
    # its children).
    engine: RankEngine = request.config.stash[HARNESS_KEY].engine(fsdp_settings.backend)
    deadline, deadline_note = None, ""
    outer = _pytest_timeout(request.node)
    if outer is not None:
        # Every check ends (stacks dumped) before pytest-timeout would stop the test blind.
        started = request.node.stash.get(STARTED_KEY, time.monotonic())
        deadline, deadline_note = outer_deadline(started, *outer)
    return Ranks(
        engine,
        world_size,
        lane=lane,
        backend=fsdp_settings.backend_for(lane),
        timeout=fsdp_settings.timeout,
        skip=_skip,
        xfail=pytest.xfail,
        deadline=deadline,
        deadline_note=deadline_note,
        gpu_share=gpu_share(request.config),
    )


__all__ = ["CheckSkipped", "ranks", "fsdp_settings", "rank_pools"]
