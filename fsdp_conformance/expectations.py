"""Known torch defects as expectations: a check that fails on the torch versions an expectation
names is an *expected failure* (``xfailed`` in the report, an xfail in pytest), not a red lane.

The expectations are a file of the package, ``fsdp_conformance/expectations.toml`` (one
``[[expected]]`` table per defect; its fields are :class:`Expectation`'s), read once. An
expectation applies to a check run as the suite runs it (its own parameters, on any model): a
negative control's run (a parameter changed) is never excused by it. It excuses only the failure
it describes: its ``match`` (a regular expression) must be found in the failure's text, and its
``raises`` (an exception's name, optional) among the exceptions the ranks raised
(:meth:`Expectation.mismatch`); any other failure of the check stays a failure, whose message
says the expectation did not match. A check that passes where an expectation says it fails
keeps its pass, and the report says the defect may be fixed (``compare`` says so too,
docs/state.md, "Expectations").

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
REQUIRED = ("check", "torch", "reason", "link", "match")
OPTIONAL = ("version", "lane", "kind", "raises")
#: What an expectation records: a torch ``defect`` (the default), or a documented behaviour
#: ``change`` that a check flags on purpose against the pinned torch (``defaults.fingerprint``).
KINDS = ("defect", "change")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")
#: An exception's name as ``raises`` gives it: ``RuntimeError``, ``torch.distributed.DistError``.
_EXCEPTION_NAME = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
#: What ``match`` is searched in, and how to write one (the parse errors' fix).
MATCH_HELP = (
    "match is a Python regular expression searched (re.search) in the failure's text: for a "
    "rank error, the error's line and every rank's traceback; for a failed verdict, its "
    "message. Take it from the measured failure: a stable part of torch's message or of the "
    "check's diagnosis"
)


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
    #: A regular expression (``re.search``) that the failure's text holds when it is this defect:
    #: a rank error's line and every rank's traceback, or a failed verdict's message.
    match: str
    #: The FSDP version it applies to (``fsdp1``/``fsdp2``); empty: both.
    version: str = ""
    #: The lane it applies to (``cpu``/``gpu``); empty: both.
    lane: str = ""
    #: :data:`KINDS`: a defect, or a documented change of behaviour.
    kind: str = "defect"
    #: The exception's name (``RuntimeError``) that a rank raised when it is this defect; empty:
    #: any failure whose text holds :attr:`match` (a failed verdict, a rank error).
    raises: str = ""

    def applies(self, check: str, version: str | None, lane: str, torch_version: str) -> bool:
        return (
            check == self.check
            and (not self.version or version == self.version)
            and (not self.lane or lane == self.lane)
            and in_range(torch_version, self.torch)
        )

    def describe(self) -> str:
        return f"{self.reason} (torch {self.torch}; {self.link})"

    def mismatch(self, text: str, raised: Sequence[str] = ()) -> str | None:
        """Why a failure is not this defect, or None when it is.

        ``text``: the failure's text (a rank error's line and every rank's traceback, or a
        failed verdict's message); ``raised``: the names of the exceptions the ranks (or the
        verdict) raised, module-qualified or not. :attr:`raises` names one of them (compared by
        the class name without its module) and :attr:`match` is found in ``text``.
        """
        if self.raises:
            wanted = self.raises.rsplit(".", 1)[-1]
            if not any(name.rsplit(".", 1)[-1] == wanted for name in raised):
                got = ", ".join(sorted(set(raised))) or "no exception (a failed verdict)"
                return f"no rank raised {self.raises} (raised: {got})"
        if re.search(self.match, text) is None:
            return f"its match {self.match!r} is not in the failure's text"
        return None

    def unmatched(self, why: str) -> str:
        """The line a covered failure that is not this defect gets (:meth:`mismatch`'s ``why``):
        the entry, its pattern and why; the failure stays a failure."""
        where = " ".join(x for x in (self.check, self.version, self.lane) if x)
        wants = f"match {self.match!r}" + (f", raises {self.raises}" if self.raises else "")
        return (
            f"the expectation did not match: expectations.toml's entry for {where} on torch "
            f"{self.torch} ({wants}) covers this check, but {why}: not the known defect, so a "
            "failure (fix the cause, or correct the entry's match if this is the defect)"
        )

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
                f"{', '.join(REQUIRED)}" + (f" ({MATCH_HELP})" if "match" in missing else "")
            )
        unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise ExpectationsError(
                f"{where} ({entry['check']}): unknown field(s) "
                f"{', '.join(unknown)}; the fields are "
                f"{', '.join(REQUIRED + OPTIONAL)}"
            )
        _check_match(entry, where)
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


def _check_match(entry: Mapping[str, Any], where: str) -> None:
    """``match`` a regular expression specific to a failure, ``raises`` an exception's name."""
    where = f"{where} ({entry['check']})"
    try:
        pattern = re.compile(entry["match"])
    except re.error as exc:
        raise ExpectationsError(
            f"{where}: match {entry['match']!r} is not a Python regular expression ({exc}); "
            f"{MATCH_HELP}"
        ) from None
    if pattern.search("") is not None:
        raise ExpectationsError(
            f"{where}: match {entry['match']!r} matches any text, so it would excuse any "
            f"failure; {MATCH_HELP}"
        )
    raises = entry.get("raises")
    if raises is not None and (not isinstance(raises, str) or not _EXCEPTION_NAME.match(raises)):
        raise ExpectationsError(
            f"{where}: raises {raises!r} is not an exception's name such as 'RuntimeError'; "
            "give the exception's class name, or leave raises out for a failed verdict"
        )


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
