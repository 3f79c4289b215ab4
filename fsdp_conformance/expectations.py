"""Known torch defects as expectations: a check that fails on the torch versions an expectation
names is an *expected failure* (``xfailed`` in the report, an xfail in pytest), not a red lane.

The expectations are a file of the package, ``fsdp_conformance/expectations.toml`` (one
``[[expected]]`` table per defect; its fields are :class:`Expectation`'s), read once. An
expectation applies to a check run as the suite runs it (its own parameters, on any model): a
negative control's run (a parameter changed) is never excused by it. A check that passes where
an expectation says it fails keeps its pass, and the report says the defect may be fixed
(``compare`` says so too, docs/state.md, "Expectations").

Imports no torch: the caller gives the torch version (the reports and ``compare`` stay light).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

#: The package's expectations file.
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expectations.toml")
#: The fields an expectation must have, and the ones it may have.
REQUIRED = ("check", "torch", "reason", "link")
OPTIONAL = ("version", "lane", "kind")
#: What an expectation records: a torch ``defect`` (the default), or a documented behaviour
#: ``change`` that a check flags on purpose against the pinned torch (``defaults.fingerprint``).
KINDS = ("defect", "change")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")


class ExpectationsError(ValueError):
    """The expectations file is malformed; the message names the entry, the field and the fix."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a torch version: ``"2.14.1+cu130"`` -> ``(2, 14, 1)`` (a local
    tag or a pre-release suffix such as ``.dev20261101`` or ``a0`` is ignored)."""
    numbers = []
    for part in version.split("+", 1)[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(numbers)


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def in_range(version: str, spec: str) -> bool:
    """Whether torch ``version`` is in ``spec``: comma-separated clauses such as
    ``">=2.13, <2.16"`` (all must hold; missing parts count as 0: ``2.13`` is ``2.13.0``)."""
    have = release(version)
    for clause in spec.split(","):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ExpectationsError(
                f"torch range {spec!r}: {clause.strip()!r} is not a clause "
                "such as '>=2.13' or '<2.16'"
            )
        op, bound = match.groups()
        a, b = _padded(have, release(bound))
        ok = {">=": a >= b, "<=": a <= b, "==": a == b, "!=": a != b, ">": a > b, "<": a < b}[op]
        if not ok:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class Expectation:
    """One known torch defect: the check it makes fail, where, why, and where it is tracked."""

    #: The check's name (``state.summon.rank0_discard``).
    check: str
    #: The torch versions it fails on: ``">=2.13, <2.16"``.
    torch: str
    #: Why, in a sentence a user can act on.
    reason: str
    #: Where it is tracked or documented (an upstream issue, a docs section).
    link: str
    #: The FSDP version it applies to (``fsdp1``/``fsdp2``); empty: both.
    version: str = ""
    #: The lane it applies to (``cpu``/``gpu``); empty: both.
    lane: str = ""
    #: :data:`KINDS`: a defect, or a documented change of behaviour.
    kind: str = "defect"

    def applies(self, check: str, version: str | None, lane: str, torch_version: str) -> bool:
        return (
            check == self.check
            and (not self.version or version == self.version)
            and (not self.lane or lane == self.lane)
            and in_range(torch_version, self.torch)
        )

    def describe(self) -> str:
        return f"{self.reason} (torch {self.torch}; {self.link})"

    def as_data(self) -> dict[str, str]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v}


def parse(entries: Sequence[Mapping[str, Any]], source: str) -> tuple[Expectation, ...]:
    """The expectations of a parsed file's ``expected`` list; each entry checked."""
    out = []
    for i, entry in enumerate(entries):
        where = f"{source}: expected[{i}]"
        if not isinstance(entry, Mapping):
            raise ExpectationsError(f"{where} is not a table; write it as [[expected]]")
        missing = [k for k in REQUIRED if not isinstance(entry.get(k), str) or not entry[k]]
        if missing:
            raise ExpectationsError(
                f"{where} ({entry.get('check', '?')}): needs "
                f"{', '.join(missing)} (strings); every entry names "
                f"{', '.join(REQUIRED)}"
            )
        unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise ExpectationsError(
                f"{where} ({entry['check']}): unknown field(s) "
                f"{', '.join(unknown)}; the fields are "
                f"{', '.join(REQUIRED + OPTIONAL)}"
            )
        if entry.get("kind", "defect") not in KINDS:
            raise ExpectationsError(
                f"{where} ({entry['check']}): kind {entry['kind']!r} is not "
                f"one of {', '.join(KINDS)}; leave it out for a defect"
            )
        try:
            in_range("0", entry["torch"])  # a malformed range fails here, not when it matches
        except ExpectationsError as exc:
            raise ExpectationsError(f"{where} ({entry['check']}): {exc}") from None
        out.append(Expectation(**{k: str(v) for k, v in entry.items()}))
    return tuple(out)


@functools.cache
def load(path: str = DEFAULT_PATH) -> tuple[Expectation, ...]:
    """The expectations in ``path`` (TOML, ``[[expected]]`` tables)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef,unused-ignore]

    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ExpectationsError(f"{path}: not valid TOML ({exc})") from None
    return parse(data.get("expected", []), path)


def known_label(kind: str | None) -> str:
    """What a report entry's ``expected`` (its ``kind``, absent in reports before it) records."""
    return "known torch change" if kind == "change" else "known torch defect"


def find(
    check: str,
    version: str | None,
    lane: str,
    torch_version: str,
    expectations: Sequence[Expectation] | None = None,
) -> Expectation | None:
    """The expectation covering ``check`` (its FSDP ``version``, ``lane``) on ``torch_version``,
    or None."""
    for expectation in load() if expectations is None else expectations:
        if expectation.applies(check, version, lane, torch_version):
            return expectation
    return None
