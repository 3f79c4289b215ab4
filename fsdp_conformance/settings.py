"""Settings, resolved once into one typed object.

Every option is declared once in :data:`OPTIONS` (name, type, default, help). The pytest
plugin and the CLI both register their flags from that table, and :func:`resolve_settings`
applies one fixed order: command line, then environment (``FSDP_CONFORMANCE_<NAME>``), then the
ini file / ``[tool.fsdp_conformance]`` table, then the default. A bad value names itself, where
it came from, and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from fsdp_conformance.sizes import MiB, parse_world_sizes


class SettingsError(ValueError):
    """A setting has a bad value; the message names it, its source and the fix."""


def _parse_backend(text: str) -> str:
    value = str(text).strip().lower()
    if value not in ("auto", "gloo", "nccl"):
        raise ValueError("expected one of auto, gloo, nccl")
    return value


#: Upper bound of a check timeout (one week). The harness waits on its ranks with ``poll()``,
#: whose timeout is milliseconds in a C int: past 2147483 s (24.8 days) every check fails with
#: ``OverflowError: timeout is too large``; pytest-timeout's ``setitimer`` overflows past 9.2e9 s
#: (a pytest INTERNALERROR). A check that needs more than a week is a hang.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _parse_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        # nan slips past `<= 0`, and inf overflows the harness's waits and pytest-timeout.
        raise ValueError("must be a finite number > 0")
    if value <= 0:
        raise ValueError("must be > 0")
    if value > MAX_TIMEOUT_S:
        raise ValueError(
            f"must be at most {MAX_TIMEOUT_S:.0f} (one week): the harness waits on its ranks "
            "with poll(), whose milliseconds overflow past 24.8 days, and a check that needs "
            "more than a week is a hang"
        )
    return value


def _parse_optional_str(text: str) -> str | None:
    value = str(text).strip()
    return value or None


def _parse_optional_positive_int(text: str) -> int | None:
    value = str(text).strip().replace("_", "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{value!r} is not a positive integer")
    return int(value)


def _parse_optional_int(text: str) -> int | None:
    value = str(text).strip().replace("_", "")
    if not value:
        return None
    as_float = float(value)  # accepts 2e7 as written in the seeds
    if not math.isfinite(as_float):
        raise ValueError("must be a finite number >= 0")  # int(inf) raises OverflowError
    number = int(as_float)
    if number < 0:
        raise ValueError("must be >= 0")
    return number


#: Resident memory of one idle rank: the interpreter, torch imported and a gloo process group
#: joined (VmRSS measured on the 2-core build machine, torch 2.13.0 CPU build: 220 MiB, of
#: which 143 MiB anonymous and 77 MiB file-backed).
RANK_BYTES = 220 * MiB
#: Share of the available memory the idle ranks may take: the checks need the rest.
RANK_MEMORY_SHARE = 0.8
#: Ranks per core. Ranks mostly wait on each other, so moderate oversubscription is fine (world
#: size 4, asked for, runs on a 2-core CI machine); this only stops a typo.
RANKS_PER_CORE = 8


@dataclasses.dataclass(frozen=True)
class WorldSizeLimit:
    """The largest world size this machine may run, and how that number was found."""

    limit: int
    how: str

    def error(self, size: int, where: str) -> str | None:
        """The one-line error for ``size`` (from ``where``) over the limit, or None."""
        if size <= self.limit:
            return None
        return (
            f"world size {size} from {where} is more than this machine can hold: at most "
            f"{self.limit} ranks ({self.how}); use a smaller world size, or set "
            f"{OPTIONS_BY_NAME['max_world_size'].flag} N (env "
            f"{OPTIONS_BY_NAME['max_world_size'].env}, or max_world_size in "
            f"[tool.{PYPROJECT_TABLE}]) to allow N ranks"
        )


def available_memory_bytes() -> int | None:
    """Memory a new process may still take: MemAvailable, capped by a cgroup v2 limit."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:
        # A container's own limit can be far below the host's free memory.
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            cap = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            used = int(f.read().strip())
        if cap != "max":
            room = max(0, int(cap) - used)
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # honours taskset and cpusets, unlike cpu_count
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: The world sizes multi-rank checks run at when none are set: each one only where the machine
#: has a core per rank (:func:`default_world_sizes`).
DEFAULT_WORLD_SIZES = (2, 4)


def default_world_sizes(cores: int) -> tuple[int, ...]:
    """:data:`DEFAULT_WORLD_SIZES` that have a core per rank here (the smallest always runs).

    Four ranks on two cores time-share: the checks still hold, but a run takes twice as long
    and every step's timing is the scheduler's, so the default leaves the larger worlds to
    machines that can hold them; naming the world sizes runs them anywhere.
    """
    smallest = DEFAULT_WORLD_SIZES[0]
    return tuple(ws for ws in DEFAULT_WORLD_SIZES if ws == smallest or ws <= cores)


def world_sizes_left_out(settings: Settings) -> str:
    """Why default world sizes are missing from ``settings`` (empty when none is)."""
    if settings.sources.get("world_sizes", "default") != "default":
        return ""
    left = [ws for ws in DEFAULT_WORLD_SIZES if ws not in settings.world_sizes]
    if not left:
        return ""
    sizes = ",".join(map(str, DEFAULT_WORLD_SIZES))
    return (
        f"{','.join(map(str, left))} left out of the default {sizes}: "
        f"{usable_cores()} core(s) here, one per rank needed; set world sizes {sizes} "
        f"({OPTIONS_BY_NAME['world_sizes'].cli_flag} / {OPTIONS_BY_NAME['world_sizes'].flag})"
        " to run it"
    )


def machine_world_size_limit(
    available: int | None = None, cores: int | None = None
) -> WorldSizeLimit:
    """min(available memory x share / per-rank cost, cores x ranks per core), at least 1."""
    available = available_memory_bytes() if available is None else available
    cores = usable_cores() if cores is None else cores
    by_cores = cores * RANKS_PER_CORE
    parts = [f"cores: {cores} x {RANKS_PER_CORE} = {by_cores}"]
    limit = by_cores
    if available is not None:
        by_memory = int(available * RANK_MEMORY_SHARE // RANK_BYTES)
        parts.insert(
            0,
            f"memory: {available / 2**30:.1f} GiB available x {RANK_MEMORY_SHARE} / "
            f"{RANK_BYTES / MiB:.0f} MiB per idle rank = {by_memory}",
        )
        limit = min(limit, by_memory)
    return WorldSizeLimit(max(1, limit), "the smaller of " + ", ".join(parts))


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting, declared once: its flag, env variable and ini key derive from ``name``."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    metavar: str = "VALUE"

    @property
    def flag(self) -> str:
        return "--fsdp-" + self.name.replace("_", "-")

    @property
    def cli_flag(self) -> str:
        """The flag of ``fsdp-conformance run`` (which accepts :attr:`flag` too)."""
        return "--" + self.name.replace("_", "-")

    def flag_in(self, flag_style: FlagStyle) -> str:
        """The flag as the front end in use spells it, for a message that names it."""
        return self.flag if flag_style == "pytest" else self.cli_flag

    @property
    def env(self) -> str:
        return "FSDP_CONFORMANCE_" + self.name.upper()

    @property
    def ini(self) -> str:
        return "fsdp_" + self.name

    @property
    def dest(self) -> str:
        return "fsdp_" + self.name


OPTIONS: tuple[Option, ...] = (
    Option(
        "world_sizes",
        parse_world_sizes,
        DEFAULT_WORLD_SIZES,
        "world sizes to run multi-rank checks at, comma separated (tests marked "
        "world_size(...) use their own; default: 2, and 4 where the machine has 4 cores)",
        "N[,N...]",
    ),
    Option(
        "backend",
        _parse_backend,
        "auto",
        "process-group backend: auto (gloo on the cpu lane, nccl on the gpu lane), gloo or nccl",
        "auto|gloo|nccl",
    ),
    Option(
        "timeout",
        _parse_seconds,
        120.0,
        "seconds one check may run on its ranks before every rank's stack is dumped and the "
        "ranks are killed",
        "SECONDS",
    ),
    Option(
        "model",
        _parse_optional_str,
        None,
        "your model: 'pkg.module:factory', a callable returning an nn.Module (built on the meta "
        "device when the suite asks; resolved from the current folder first, as python -m does)",
        "MODULE:FACTORY",
    ),
    Option(
        "block_cls",
        _parse_optional_str,
        None,
        "the transformer block class of --fsdp-model: a dotted import path or a class name found "
        "in the model (default for a transformers model: its _no_split_modules)",
        "CLASS",
    ),
    Option(
        "min_params",
        _parse_optional_int,
        None,
        "size-policy threshold in parameters for modules outside the blocks (default: scaled "
        "from the model, as 2e7 is to dim 4096 in the seeds)",
        "N",
    ),
    Option(
        "input",
        _parse_optional_str,
        None,
        "'pkg.module:builder' returning a batch for --fsdp-model: builder(model, batch_size, "
        "device) -> the model's one argument (a tensor or tuple), or a mapping of keyword "
        "arguments",
        "MODULE:BUILDER",
    ),
    Option(
        "max_world_size",
        _parse_optional_positive_int,
        None,
        "the largest world size this machine may run (default: derived from available memory "
        "and cores, see docs/harness.md); set it to run larger worlds than the default allows",
        "N",
    ),
    Option(
        "init_fn",
        _parse_optional_str,
        None,
        "'pkg.module:fn', the per-module init of --fsdp-model for meta-device init: fn(module) "
        "initializes the module's own parameters and buffers, called per module as "
        "reset_parameters() is (default: each module's reset_parameters(), or transformers' "
        "_init_weights for a PreTrainedModel)",
        "MODULE:FN",
    ),
    Option(
        "model_init",
        _parse_optional_str,
        None,
        "'pkg.module:fn', the model-level init of --fsdp-model for meta-device init: fn(model) "
        "initializes the whole model in place after to_empty, on its sharded parameters, in "
        "place of per-module init (default: the root's own init_weights(buffer_device=None) "
        "when it has one, as torchtitan's models do)",
        "MODULE:FN",
    ),
)

OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything the suite needs to know, resolved once per session."""

    #: World sizes multi-rank checks run at, unless a test's ``world_size`` marker says otherwise
    #: (unset: :func:`default_world_sizes`, resolved by :func:`resolve_settings`).
    world_sizes: tuple[int, ...] = (2,)
    #: ``auto`` picks gloo for the cpu lane and nccl for the gpu lane.
    backend: str = "auto"
    #: Seconds one check may take on its ranks.
    timeout: float = 120.0
    #: ``pkg.module:factory`` of the user's model, or None for the reference models only.
    model: str | None = None
    #: Block class of the user's model (class path or name), or None to infer it.
    block_cls: str | None = None
    #: Size-policy threshold, or None to scale it from the model.
    min_params: int | None = None
    #: ``pkg.module:builder`` of the user's inputs, or None for a default builder.
    input: str | None = None
    #: An explicit world-size limit, or None to derive it from the machine.
    max_world_size: int | None = None
    #: ``pkg.module:fn`` initializing one module's own state (meta init), or None for the
    #: model's own contract (``reset_parameters()``, or transformers' ``_init_weights``).
    init_fn: str | None = None
    #: ``pkg.module:fn`` initializing the whole model after ``to_empty`` (meta init), or None
    #: for the root's own ``init_weights()`` when it has one.
    model_init: str | None = None
    #: Where each value came from ("default", "ini", "env FSDP_...", "--fsdp-..."), for headers.
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def backend_for(self, lane: str) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if lane == "gpu" else "gloo"


def resolve_settings(
    cli: Mapping[str, Any],
    environ: Mapping[str, str],
    ini: Mapping[str, Any],
    pyproject: Mapping[str, Any] | None = None,
    *,
    machine_limit: Callable[[], WorldSizeLimit] = machine_world_size_limit,
    flag_style: FlagStyle = "pytest",
    cores: Callable[[], int] | None = None,
) -> Settings:
    """Resolve every option: CLI, then environment, then ini, then pyproject, then the default.

    ``cli`` maps option names to values given on the command line (None: not given);
    ``ini`` maps option names to raw values from pytest's ini file; ``pyproject`` maps them to
    values of the ``[tool.fsdp_conformance]`` table (see :func:`pyproject_settings`).
    World sizes above what the machine can hold (``machine_limit``, unless ``max_world_size``
    is set) are a :class:`SettingsError`, before any rank process starts, and so is a model
    option without the model; ``flag_style`` spells the flags in that message as the caller's
    interface does (``pytest``: ``--fsdp-block-cls``; ``cli``: ``--block-cls``). World sizes
    left unset are :func:`default_world_sizes` of ``cores()`` (default :func:`usable_cores`).
    """
    pyproject = pyproject or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in OPTIONS:
        raw: Any = None
        source = "default"
        if cli.get(option.name) is not None:
            raw, source = cli[option.name], f"command line {option.flag}"
        elif environ.get(option.env):
            raw, source = environ[option.env], f"environment variable {option.env}"
        elif ini.get(option.name) not in (None, "", []):
            raw, source = ini[option.name], f"ini key {option.ini}"
        elif pyproject.get(option.name) not in (None, "", []):
            raw = pyproject[option.name]
            source = f"pyproject.toml [tool.{PYPROJECT_TABLE}] {option.name}"
        if source == "default" and option.name == "world_sizes":
            values[option.name] = default_world_sizes((cores or usable_cores)())
        elif source == "default":
            values[option.name] = option.default
        else:
            values[option.name] = _parse(option, raw, source)
        sources[option.name] = source
    settings = Settings(**values, sources=sources)
    limit = world_size_limit(settings, environ, machine_limit)
    if limit is not None:
        for size in settings.world_sizes:
            message = limit.error(size, sources["world_sizes"])
            if message:
                raise SettingsError(message)
    _check_model_options(settings, flag_style)
    return settings


#: How an interface spells an option's flag: the plugin's ``--fsdp-block-cls`` or the CLI's
#: ``--block-cls``.
FlagStyle = Literal["pytest", "cli"]


def _flag(name: str, flag_style: FlagStyle) -> str:
    return OPTIONS_BY_NAME[name].flag_in(flag_style)


def _check_model_options(settings: Settings, flag_style: FlagStyle) -> None:
    """A model option without the model would otherwise be ignored without a word."""
    if settings.init_fn and settings.model_init:
        raise SettingsError(
            f"{_flag('init_fn', flag_style)} and {_flag('model_init', flag_style)} are both "
            "set: a model has one init, per module or for the whole model; keep the one the "
            "model's training script uses"
        )
    if settings.model:
        return
    for name in ("block_cls", "input", "init_fn", "model_init"):
        if getattr(settings, name):
            model = _flag("model", flag_style)
            raise SettingsError(
                f"{_flag(name, flag_style)} is set but no {model}: give the model factory "
                f"too (e.g. {model} mypkg.model:build_model)"
            )


def world_size_limit(
    settings: Settings,
    environ: Mapping[str, str],
    machine_limit: Callable[[], WorldSizeLimit] = machine_world_size_limit,
) -> WorldSizeLimit | None:
    """The largest world size allowed here: ``max_world_size`` if set, else the machine's.

    None under an external launcher: it started the ranks and sized the world, not us.
    (Not a field of :class:`Settings`: the machine's figure changes run to run, and the
    settings go into reports that are compared.)
    """
    if all(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")):
        return None
    if settings.max_world_size is not None:
        source = settings.sources.get("max_world_size", "max_world_size")
        return WorldSizeLimit(settings.max_world_size, f"set by {source}")
    return machine_limit()


def _parse(option: Option, raw: Any, source: str) -> Any:
    if isinstance(raw, (list, tuple)):
        raw = ",".join(str(x) for x in raw)
    try:
        return option.parse(str(raw))
    except (TypeError, ValueError) as exc:
        raise SettingsError(
            f"invalid {option.name} {str(raw)!r} from {source}: {exc}; "
            f"expected {option.metavar} ({option.help})"
        ) from None


PYPROJECT_TABLE = "fsdp_conformance"


def pyproject_settings(start: str) -> dict[str, Any]:
    """The ``[tool.fsdp_conformance]`` table of the nearest pyproject.toml at or above ``start``.

    Keys are option names (``world_sizes``, ``model``, ``block_cls``, ...); an unknown key is an
    error naming the known ones.
    """
    import os

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef,unused-ignore]

    directory = os.path.abspath(start)
    while True:
        path = os.path.join(directory, "pyproject.toml")
        if os.path.isfile(path):
            break
        parent = os.path.dirname(directory)
        if parent == directory:
            return {}
        directory = parent
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path} is not valid TOML ({exc})") from None
    table = data.get("tool", {}).get(PYPROJECT_TABLE, {})
    if not isinstance(table, dict):
        raise SettingsError(
            f"tool.{PYPROJECT_TABLE} in {path} is not a table; write it as "
            f"[tool.{PYPROJECT_TABLE}] with keys {', '.join(OPTIONS_BY_NAME)}"
        )
    unknown = sorted(set(table) - set(OPTIONS_BY_NAME))
    if unknown:
        raise SettingsError(
            f"unknown key(s) {', '.join(unknown)} in [tool.{PYPROJECT_TABLE}] of {path}; "
            f"known keys: {', '.join(OPTIONS_BY_NAME)}"
        )
    return dict(table)
