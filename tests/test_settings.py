"""Settings: one table of options, one resolve order, and errors that name value, source and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_conformance import cli
from fsdp_conformance.settings import (
    OPTIONS,
    Settings,
    SettingsError,
    pyproject_settings,
    resolve_settings,
)

pytestmark = pytest.mark.cpu


def test_defaults_when_nothing_is_given() -> None:
    s = resolve_settings({}, {}, {})
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
    s = resolve_settings({}, {"FSDP_CONFORMANCE_BACKEND": ""}, {"backend": ""},
                         {"backend": "gloo"})
    assert s.backend == "gloo"
    assert s.sources["backend"] == "pyproject.toml [tool.fsdp_conformance] backend"


def test_values_are_parsed_into_their_types() -> None:
    s = resolve_settings(
        {"world_sizes": "2, 4,2", "backend": "NCCL", "min_params": "2e7"}, {},
        {"timeout": "7.5"}, {"block_cls": " Block ", "input": "pkg.mod:batch"},
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
        ("cli", "backend", "mpi",
         ("invalid backend 'mpi' from command line --fsdp-backend: expected one of auto, gloo, "
          "nccl; expected auto|gloo|nccl")),
        ("env", "world_sizes", "two",
         ("invalid world_sizes 'two' from environment variable FSDP_CONFORMANCE_WORLD_SIZES: "
          "'two' is not a positive integer; expected N[,N...]")),
        ("ini", "timeout", "0",
         "invalid timeout '0' from ini key fsdp_timeout: must be > 0; expected SECONDS"),
        ("pyproject", "min_params", "-5",
         ("invalid min_params '-5' from pyproject.toml [tool.fsdp_conformance] min_params: "
          "must be >= 0; expected N")),
        ("pyproject", "world_sizes", [2, 0],
         ("invalid world_sizes '2,0' from pyproject.toml [tool.fsdp_conformance] world_sizes: "
          "'0' is not a positive integer")),
        ("env", "timeout", "soon",
         "invalid timeout 'soon' from environment variable FSDP_CONFORMANCE_TIMEOUT"),
        # nan passes a plain `<= 0` test; inf overflows the harness's waits and pytest-timeout.
        ("cli", "timeout", "nan",
         "invalid timeout 'nan' from command line --fsdp-timeout: must be a finite number > 0"),
        ("env", "timeout", "inf",
         ("invalid timeout 'inf' from environment variable FSDP_CONFORMANCE_TIMEOUT: must be a "
          "finite number > 0")),
        # int(float('1e999')) raises OverflowError, which is not a ValueError.
        ("cli", "min_params", "1e999",
         "invalid min_params '1e999' from command line --fsdp-min-params: must be a finite"),
    ],
)
def test_bad_value_names_the_value_its_source_and_the_fix(
    where: str, name: str, value: object, expected: str
) -> None:
    option = next(o for o in OPTIONS if o.name == name)
    given = {"cli": ({name: value}, {}, {}, {}),
             "env": ({}, {option.env: value}, {}, {}),
             "ini": ({}, {}, {name: value}, {}),
             "pyproject": ({}, {}, {}, {name: value})}[where]
    with pytest.raises(SettingsError) as info:
        resolve_settings(*given)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(expected)
    assert option.help in message  # the fix: what the option takes
    assert "\n" not in message


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
    parser = cli.build_parser()
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
    args = cli.build_parser().parse_args(["run", "--backend", "auto"])
    s = cli.resolve_cli_settings(args)
    assert (s.world_sizes, s.backend, s.timeout) == ((2, 4), "auto", 45.0)
    assert s.sources["world_sizes"] == "pyproject.toml [tool.fsdp_conformance] world_sizes"
    assert s.sources["backend"] == "command line --fsdp-backend"
    assert s.sources["timeout"] == "environment variable FSDP_CONFORMANCE_TIMEOUT"
