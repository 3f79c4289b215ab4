"""Settings: one table of options, one resolve order, and errors that name value, source and fix."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from fsdp_conformance import cli, cli_parser
from fsdp_conformance.settings import (
    MAX_TIMEOUT_S,
    OPTIONS,
    RANK_BYTES,
    Settings,
    SettingsError,
    WorldSizeLimit,
    machine_world_size_limit,
    pyproject_settings,
    resolve_settings,
    world_size_limit,
)

pytestmark = pytest.mark.cpu


def test_defaults_when_nothing_is_given() -> None:
    # Two cores, as on CI: world size 4 of the default has no core per rank there
    # (tests/test_world_sizes_default.py covers the rule).
    s = resolve_settings({}, {}, {}, cores=lambda: 2)
    assert s == Settings()
    assert s.world_sizes == (2,) and s.backend == "auto" and s.timeout == 120.0
    assert s.model is None and s.block_cls is None and s.min_params is None
    assert dict(s.sources) == {o.name: "default" for o in OPTIONS}


def test_command_line_beats_environment_beats_ini_beats_pyproject() -> None:
    every = {"world_sizes": "2", "timeout": "10", "model": "a.m:f", "block_cls": "A"}
    cli_values = {"world_sizes": "4"}
    env = {"FSDP_CONFORMANCE_WORLD_SIZES": "3", "FSDP_CONFORMANCE_TIMEOUT": "20"}
    ini = {"world_sizes": "5", "timeout": "30", "model": "ini.m:f"}
    s = resolve_settings(cli_values, env, ini, every)
    assert s.world_sizes == (4,)
    assert s.timeout == 20.0
    assert s.model == "ini.m:f"
    assert s.block_cls == "A"
    assert s.backend == "auto"
    assert s.sources["world_sizes"] == "command line --fsdp-world-sizes"
    assert s.sources["timeout"] == "environment variable FSDP_CONFORMANCE_TIMEOUT"
    assert s.sources["model"] == "ini key fsdp_model"
    assert s.sources["block_cls"] == "pyproject.toml [tool.fsdp_conformance] block_cls"
    assert s.sources["backend"] == "default"


def test_empty_environment_variable_and_empty_ini_value_count_as_not_set() -> None:
    s = resolve_settings({}, {"FSDP_CONFORMANCE_BACKEND": ""}, {"backend": ""}, {"backend": "gloo"})
    assert s.backend == "gloo"
    assert s.sources["backend"] == "pyproject.toml [tool.fsdp_conformance] backend"


def test_values_are_parsed_into_their_types() -> None:
    s = resolve_settings(
        {"world_sizes": "2, 4,2", "backend": "NCCL", "min_params": "2e7"},
        {},
        {"timeout": "7.5"},
        {"block_cls": " Block ", "input": "pkg.mod:batch", "model": "p.m:f"},
    )
    assert s.world_sizes == (2, 4)  # order kept, duplicates dropped
    assert s.backend == "nccl" and s.timeout == 7.5 and s.min_params == 20_000_000
    assert s.block_cls == "Block" and s.input == "pkg.mod:batch"
    # TOML gives lists and numbers, not strings
    t = resolve_settings({}, {}, {}, {"world_sizes": [2, 4], "min_params": 20_000_000})
    assert t.world_sizes == (2, 4) and t.min_params == 20_000_000
    assert resolve_settings({"min_params": "20_000_000"}, {}, {}).min_params == 20_000_000


def test_backend_for_each_lane() -> None:
    assert Settings().backend_for("cpu") == "gloo"
    assert Settings().backend_for("gpu") == "nccl"
    assert Settings(backend="gloo").backend_for("gpu") == "gloo"


@pytest.mark.parametrize(
    ("where", "name", "value", "expected"),
    [
        (
            "cli",
            "backend",
            "mpi",
            (
                "invalid backend 'mpi' from command line --fsdp-backend: expected one of auto, gloo, "
                "nccl; expected auto|gloo|nccl"
            ),
        ),
        (
            "env",
            "world_sizes",
            "two",
            (
                "invalid world_sizes 'two' from environment variable FSDP_CONFORMANCE_WORLD_SIZES: "
                "'two' is not a positive integer; expected N[,N...]"
            ),
        ),
        (
            "ini",
            "timeout",
            "0",
            "invalid timeout '0' from ini key fsdp_timeout: must be > 0; expected SECONDS",
        ),
        (
            "pyproject",
            "min_params",
            "-5",
            (
                "invalid min_params '-5' from pyproject.toml [tool.fsdp_conformance] min_params: "
                "must be >= 0; expected N"
            ),
        ),
        (
            "pyproject",
            "world_sizes",
            [2, 0],
            (
                "invalid world_sizes '2,0' from pyproject.toml [tool.fsdp_conformance] world_sizes: "
                "'0' is not a positive integer"
            ),
        ),
        (
            "env",
            "timeout",
            "soon",
            "invalid timeout 'soon' from environment variable FSDP_CONFORMANCE_TIMEOUT",
        ),
        # nan passes a plain `<= 0` test; inf overflows the harness's waits and pytest-timeout.
        (
            "cli",
            "timeout",
            "nan",
            "invalid timeout 'nan' from command line --fsdp-timeout: must be a finite number > 0",
        ),
        (
            "env",
            "timeout",
            "inf",
            (
                "invalid timeout 'inf' from environment variable FSDP_CONFORMANCE_TIMEOUT: must be a "
                "finite number > 0"
            ),
        ),
        # int(float('1e999')) raises OverflowError, which is not a ValueError.
        (
            "cli",
            "min_params",
            "1e999",
            "invalid min_params '1e999' from command line --fsdp-min-params: must be a finite",
        ),
        # poll()'s milliseconds overflow a C int past 24.8 days: OverflowError in every check.
        (
            "cli",
            "timeout",
            "2.2e6",
            "invalid timeout '2.2e6' from command line --fsdp-timeout: must be at most 604800 "
            "(one week)",
        ),
        # setitimer overflows past 9.2e9 s: a pytest INTERNALERROR.
        (
            "env",
            "timeout",
            "1e12",
            "invalid timeout '1e12' from environment variable FSDP_CONFORMANCE_TIMEOUT: must be "
            "at most 604800",
        ),
        (
            "ini",
            "max_world_size",
            "0",
            "invalid max_world_size '0' from ini key fsdp_max_world_size: '0' is not a positive "
            "integer; expected N",
        ),
    ],
)
def test_bad_value_names_the_value_its_source_and_the_fix(
    where: str, name: str, value: object, expected: str
) -> None:
    option = next(o for o in OPTIONS if o.name == name)
    given = {
        "cli": ({name: value}, {}, {}, {}),
        "env": ({}, {option.env: value}, {}, {}),
        "ini": ({}, {}, {name: value}, {}),
        "pyproject": ({}, {}, {}, {name: value}),
    }[where]
    with pytest.raises(SettingsError) as info:
        resolve_settings(*given)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(expected)
    assert option.help in message  # the fix: what the option takes
    assert "\n" not in message


@pytest.mark.parametrize(
    ("flag_style", "given", "expected"),
    [
        (
            "pytest",
            ({"block_cls": "Block"}, {}, {}),
            "--fsdp-block-cls is set but no --fsdp-model: give the model factory too (e.g. "
            "--fsdp-model mypkg.model:build_model)",
        ),
        (
            "cli",
            ({"block_cls": "Block"}, {}, {}),
            "--block-cls is set but no --model: give the model factory too (e.g. --model "
            "mypkg.model:build_model)",
        ),
        # from any source: the rule is on the resolved settings, not on the command line
        (
            "cli",
            ({}, {"FSDP_CONFORMANCE_INPUT": "pkg.mod:batch"}, {}),
            "--input is set but no --model: give the model factory too",
        ),
        (
            "pytest",
            ({}, {}, {"input": "pkg.mod:batch"}),
            "--fsdp-input is set but no --fsdp-model: give the model factory too",
        ),
    ],
)
def test_a_model_option_without_the_model_is_a_settings_error(
    flag_style: Literal["pytest", "cli"], given: tuple[dict[str, str], ...], expected: str
) -> None:
    """One rule for the plugin and the CLI, each spelling the flags as its users type them."""
    with pytest.raises(SettingsError) as info:
        resolve_settings(*given, flag_style=flag_style)
    assert str(info.value).startswith(expected)


def test_a_model_option_with_the_model_resolves() -> None:
    s = resolve_settings(
        {"model": "pkg.m:f", "block_cls": "Block"},
        {"FSDP_CONFORMANCE_INPUT": "pkg.mod:batch"},
        {},
        flag_style="cli",
    )
    assert (s.model, s.block_cls, s.input) == ("pkg.m:f", "Block", "pkg.mod:batch")


def test_a_bad_value_is_reported_even_when_a_lower_source_is_fine() -> None:
    with pytest.raises(SettingsError, match="from environment variable"):
        resolve_settings({}, {"FSDP_CONFORMANCE_BACKEND": "tcp"}, {"backend": "gloo"})


# --------------------------------------------------------------------------------------------
# [tool.fsdp_conformance]
# --------------------------------------------------------------------------------------------


def test_pyproject_table_is_found_from_a_subfolder(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.fsdp_conformance]\nworld_sizes = [2, 4]\n'
        'model = "mypkg.model:build"\nmin_params = 2e7\n'
    )
    sub = tmp_path / "src" / "deep"
    sub.mkdir(parents=True)
    table = pyproject_settings(str(sub))
    assert table == {"world_sizes": [2, 4], "model": "mypkg.model:build", "min_params": 2e7}
    s = resolve_settings({}, {}, {}, table)
    assert s.world_sizes == (2, 4) and s.min_params == 20_000_000


def test_pyproject_without_the_table_or_no_pyproject_gives_nothing(tmp_path: Path) -> None:
    assert pyproject_settings(str(tmp_path)) == {}  # none up to / (tmp is outside the repo)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert pyproject_settings(str(tmp_path)) == {}


def test_unknown_pyproject_key_is_an_error_naming_the_known_keys(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.fsdp_conformance]\nworld_size = [2]\n")
    with pytest.raises(SettingsError) as info:
        pyproject_settings(str(tmp_path))
    message = str(info.value)
    assert "unknown key(s) world_size in [tool.fsdp_conformance]" in message
    assert str(tmp_path / "pyproject.toml") in message
    known = "known keys: world_sizes, backend, timeout, model, block_cls, min_params, input"
    assert known in message


def test_invalid_toml_and_a_non_table_are_errors_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text("[tool.fsdp_conformance\nworld_sizes = 2\n")
    with pytest.raises(SettingsError, match=r"pyproject.toml is not valid TOML"):
        pyproject_settings(str(tmp_path))
    path.write_text('[tool]\nfsdp_conformance = "2"\n')
    with pytest.raises(SettingsError, match=r"tool.fsdp_conformance in .* is not a table"):
        pyproject_settings(str(tmp_path))


# --------------------------------------------------------------------------------------------
# One table, two front ends
# --------------------------------------------------------------------------------------------


def test_every_option_is_a_cli_flag_under_both_spellings() -> None:
    parser = cli_parser.build_parser()
    for option in OPTIONS:
        short = "--" + option.name.replace("_", "-")
        for flag in (short, option.flag):
            args = parser.parse_args(["run", flag, "7"])
            assert getattr(args, option.name) == "7", flag


def test_cli_settings_resolve_command_line_env_and_pyproject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.fsdp_conformance]\nworld_sizes = [2, 4]\nbackend = "gloo"\ntimeout = 30\n'
    )
    monkeypatch.chdir(tmp_path)
    for option in OPTIONS:
        monkeypatch.delenv(option.env, raising=False)
    monkeypatch.setenv("FSDP_CONFORMANCE_TIMEOUT", "45")
    args = cli_parser.build_parser().parse_args(["run", "--backend", "auto"])
    s = cli.resolve_cli_settings(args)
    assert (s.world_sizes, s.backend, s.timeout) == ((2, 4), "auto", 45.0)
    assert s.sources["world_sizes"] == "pyproject.toml [tool.fsdp_conformance] world_sizes"
    assert s.sources["backend"] == "command line --fsdp-backend"
    assert s.sources["timeout"] == "environment variable FSDP_CONFORMANCE_TIMEOUT"


# --------------------------------------------------------------------------------------------
# Bounds: world sizes the machine can hold, timeouts the waits can take
# --------------------------------------------------------------------------------------------


def _machine_of(limit: int) -> WorldSizeLimit:
    return WorldSizeLimit(limit, f"a test machine of {limit} ranks")


def test_the_longest_timeout_is_accepted_and_fits_every_wait() -> None:
    import select
    import socket
    import threading

    s = resolve_settings({"timeout": str(MAX_TIMEOUT_S)}, {}, {})
    assert s.timeout == MAX_TIMEOUT_S
    # The harness's waits (multiprocessing.connection.wait: poll() in milliseconds) take it...
    a, b = socket.socketpair()
    with a, b:
        poller = select.poll()
        poller.register(a, select.POLLIN)
        b.send(b"x")
        assert poller.poll(MAX_TIMEOUT_S * 1000)
        with pytest.raises(OverflowError):  # ...where 2.2e6 s did not
            poller.poll(2.2e6 * 1000)
    # ...and so does pytest-timeout for the plugin's outer guard (5 timeouts plus 60 s), as
    # setitimer or a threading.Timer: both stop at threading.TIMEOUT_MAX.
    assert MAX_TIMEOUT_S * 5 + 60 < threading.TIMEOUT_MAX


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("cli", "command line --fsdp-world-sizes"),
        ("env", "environment variable FSDP_CONFORMANCE_WORLD_SIZES"),
        ("pyproject", "pyproject.toml [tool.fsdp_conformance] world_sizes"),
    ],
)
def test_world_size_over_the_machine_limit_is_one_error_with_limit_rule_and_override(
    where: str, source: str
) -> None:
    given = {
        "cli": ({"world_sizes": "2,1000"}, {}, {}, {}),
        "env": ({}, {"FSDP_CONFORMANCE_WORLD_SIZES": "2,1000"}, {}, {}),
        "pyproject": ({}, {}, {}, {"world_sizes": [2, 1000]}),
    }[where]
    with pytest.raises(SettingsError) as info:
        resolve_settings(*given, machine_limit=lambda: _machine_of(16))  # type: ignore[arg-type]
    assert str(info.value) == (
        f"world size 1000 from {source} is more than this machine can hold: at most 16 ranks "
        "(a test machine of 16 ranks); use a smaller world size, or set --fsdp-max-world-size N "
        "(env FSDP_CONFORMANCE_MAX_WORLD_SIZE, or max_world_size in [tool.fsdp_conformance]) "
        "to allow N ranks"
    )


def test_a_hundred_thousand_ranks_are_refused_on_this_very_machine() -> None:
    with pytest.raises(
        SettingsError,
        match=r"world size 100000 from command line .* at most "
        r"\d+ ranks \(the smaller of memory: .* GiB available x 0.8 / 220 MiB "
        r"per idle rank = \d+, cores: \d+ x 8 = \d+\)",
    ):
        resolve_settings({"world_sizes": "100000"}, {}, {})


def test_max_world_size_overrides_the_machine_limit_either_way() -> None:
    s = resolve_settings(
        {"world_sizes": "32"},
        {"FSDP_CONFORMANCE_MAX_WORLD_SIZE": "32"},
        {},
        machine_limit=lambda: _machine_of(16),
    )
    assert s.world_sizes == (32,) and s.max_world_size == 32
    assert world_size_limit(s, {}) == WorldSizeLimit(
        32, "set by environment variable FSDP_CONFORMANCE_MAX_WORLD_SIZE"
    )
    with pytest.raises(
        SettingsError,
        match=r"^world size 4 from ini key fsdp_world_sizes is more "
        r"than this machine can hold: at most 2 ranks \(set by command line "
        r"--fsdp-max-world-size\)",
    ):
        resolve_settings({"max_world_size": "2"}, {}, {"world_sizes": "2,4"})


def test_under_an_external_launcher_world_sizes_are_not_bounded_here() -> None:
    launcher = {"RANK": "0", "WORLD_SIZE": "64", "LOCAL_RANK": "0", "MASTER_ADDR": "host"}
    s = resolve_settings({"world_sizes": "64"}, launcher, {}, machine_limit=lambda: _machine_of(2))
    assert s.world_sizes == (64,) and world_size_limit(s, launcher) is None


def test_limit_rule_memory_first_and_a_generous_core_factor() -> None:
    gib = 2**30
    # The 2-core CI machine: world sizes 2 and 4 (and more), asked for, stay allowed.
    ci = machine_world_size_limit(available=16 * gib, cores=2)
    assert ci.limit == 16
    assert ci.how == (
        "the smaller of memory: 16.0 GiB available x 0.8 / 220 MiB per idle "
        "rank = 59, cores: 2 x 8 = 16"
    )
    assert resolve_settings({"world_sizes": "2,4"}, {}, {}, machine_limit=lambda: ci)
    # Memory binds first on a small machine: 1 GiB holds 3 idle ranks at 80 %.
    assert machine_world_size_limit(available=1 * gib, cores=64).limit == 3
    assert int(0.8 * gib // RANK_BYTES) == 3
    # Never below one rank.
    assert machine_world_size_limit(available=0, cores=2).limit == 1


def test_cli_run_refuses_a_world_size_over_the_limit_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import fsdp_conformance.gate.suite as suite

    def _no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the suite started although the world size was refused")

    monkeypatch.chdir(tmp_path)
    for option in OPTIONS:
        monkeypatch.delenv(option.env, raising=False)
    monkeypatch.setattr(suite, "run_suite", _no_run)
    code = cli.main(["run", "--world-sizes", "1000", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE
    assert (
        "world size 1000 from command line --fsdp-world-sizes is more than this machine "
        "can hold: at most" in err
    )
    assert "--fsdp-max-world-size N" in err
    assert len(err.strip().splitlines()) == 1
