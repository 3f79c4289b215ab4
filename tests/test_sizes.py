"""sizes.py: the one byte formatter, the byte-size parser and the one world-size parser, and
the callers that wrap their ValueError in their own error type (settings, planner)."""

from __future__ import annotations

import pytest

from fsdp_conformance import sizes
from fsdp_conformance.plan.model import PlanError
from fsdp_conformance.plan.model import parse_bytes as plan_parse_bytes
from fsdp_conformance.plan.model import parse_world_sizes as plan_parse_world_sizes
from fsdp_conformance.settings import SettingsError, resolve_settings
from fsdp_conformance.sizes import MB, MiB, format_bytes, parse_bytes, parse_world_sizes

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    ("n", "style", "text"),
    [
        # binary: reports and compare; KiB below a MiB so small units do not all read 0.00 MiB
        (27 * MiB + MiB // 2, "binary", "27.50 MiB"),
        (MiB, "binary", "1.00 MiB"),
        (MiB - 1024, "binary", "1023.0 KiB"),
        (0, "binary", "0.0 KiB"),
        (-3 * MiB, "binary", "-3.00 MiB"),
        # decimal: the planner, the largest unit that fits, whole bytes below a KB
        (141e9, "decimal", "141.00 GB"),
        (1.5e12, "decimal", "1.50 TB"),
        (2_400_000, "decimal", "2.40 MB"),
        (999, "decimal", "999 B"),
        (1000, "decimal", "1.00 KB"),
        (-5e9, "decimal", "-5.00 GB"),
        # iec: the planner's default (devices report GiB), the largest unit that fits
        (80 * 2**30, "iec", "80.00 GiB"),
        (1.5 * 2**40, "iec", "1.50 TiB"),
        (2**20 - 1024, "iec", "1023.00 KiB"),
        (999, "iec", "999 B"),
        # MB: the memory claim, always decimal MB
        (2 * MB, "MB", "2.00 MB"),
        (1.5e9, "MB", "1500.00 MB"),
        (12_345, "MB", "0.01 MB"),
    ],
)
def test_format_bytes_styles(n: float, style: sizes.ByteStyle, text: str) -> None:
    assert format_bytes(n, style) == text


def test_format_bytes_defaults_to_binary_and_refuses_an_unknown_style() -> None:
    assert format_bytes(3 * MiB) == "3.00 MiB"
    with pytest.raises(ValueError, match="unknown byte style 'GiB'; use one of binary"):
        format_bytes(1, "GiB")  # type: ignore[arg-type]


def test_a_size_is_shown_back_in_the_units_it_was_given_in() -> None:
    assert sizes.size_style(parse_bytes("80GiB")) == "iec"
    assert sizes.size_style(parse_bytes("80GB")) == "decimal"
    assert sizes.size_style(parse_bytes("8e10")) == "decimal"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80GB", 80 * 10**9),
        ("141 GB", 141 * 10**9),
        ("80GiB", 80 * 2**30),
        ("8e10", 8 * 10**10),
        ("512mib", 512 * 2**20),
        (" 1.5 TB ", 15 * 10**11),
        ("4096", 4096),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "80 potatoes",
            "--device-memory '80 potatoes' is not a size; write e.g. 80GB, 141GB or 80GiB",
        ),
        ("GB", "--device-memory 'GB' is not a size"),
        ("-4GB", "--device-memory '-4GB' is not a size"),
        ("0GB", "--device-memory '0GB' must be positive"),
    ],
)
def test_parse_bytes_errors_name_the_value_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(text)
    assert str(info.value).startswith(message)
    # The planner keeps its own error type, with the same text.
    with pytest.raises(PlanError) as plan_info:
        plan_parse_bytes(text)
    assert str(plan_info.value) == str(info.value)


def test_parse_bytes_names_the_flag_it_came_from() -> None:
    with pytest.raises(ValueError, match="^--budget 'x' is not a size"):
        parse_bytes("x", "--budget")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", (2,)),
        ("2,4", (2, 4)),
        ("2 4", (2, 4)),
        ("2, 4,2", (2, 4)),
        (",8,,64,", (8, 64)),
        ("8,64,512,1024", (8, 64, 512, 1024)),
    ],
)
def test_parse_world_sizes_order_kept_duplicates_dropped(text: str, value: tuple[int, ...]) -> None:
    assert parse_world_sizes(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("two", "'two' is not a positive integer"),
        ("2,0", "'0' is not a positive integer"),
        ("-1", "'-1' is not a positive integer"),
        ("+3", "'+3' is not a positive integer"),
        ("2.5", "'2.5' is not a positive integer"),
        ("", "no world size given"),
        (" , ", "no world size given"),
    ],
)
def test_parse_world_sizes_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_world_sizes(text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "8,x",
            "--world-sizes '8,x' is not a comma-separated list of integers; write e.g. "
            "8,64,512,1024",
        ),
        ("+3", "--world-sizes '+3' is not a comma-separated list of integers"),
        ("8,0", "--world-sizes '8,0' needs integers >= 1, e.g. 8,64,512,1024"),
        ("-1", "--world-sizes '-1' needs integers >= 1"),
        ("", "--world-sizes '' needs integers >= 1"),
    ],
)
def test_planner_world_sizes_keep_the_planner_texts(text: str, message: str) -> None:
    with pytest.raises(PlanError) as info:
        plan_parse_world_sizes(text)
    assert str(info.value).startswith(message)


def test_planner_and_settings_share_one_world_size_parser() -> None:
    """The planner reads world sizes with the suite's rules: spaces, duplicates dropped."""
    assert plan_parse_world_sizes("8, 64 8") == (8, 64)
    settings = resolve_settings({"world_sizes": "2 4,2"}, {}, {}, max_world_size_free())
    assert settings.world_sizes == (2, 4)
    with pytest.raises(SettingsError, match="'x' is not a positive integer; expected N"):
        resolve_settings({"world_sizes": "2,x"}, {}, {})


def max_world_size_free() -> dict[str, int]:
    # An explicit limit, so the machine's figure cannot refuse the sizes this test asks for.
    return {"max_world_size": 8}
