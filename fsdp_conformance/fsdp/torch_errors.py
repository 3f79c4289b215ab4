"""Known torch errors and their fixes: a rank's traceback read as one line a user can act on.

A check whose ranks raised ends as an ``error``; the ranks' tracebacks are 60 to 200 lines deep
in torch. :func:`failure_line` turns them into one line naming the exception, where it was
raised (the innermost frame: ``torch/distributed/fsdp/...py:function`` where torch raised it;
the user's forward where that raised, not torch's module call around it), the ranks that raised
it and, for an error of :data:`KNOWN_ERRORS`, the public API, what it means and the fix. The
tracebacks themselves stay in the report.

Each entry of :data:`KNOWN_ERRORS` matches on stable parts of torch's text (the exception type,
a fragment of its message, a torch file its traceback passes through), never on line numbers;
``tests/test_reports.py`` holds one test per entry with the text torch raises.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsdp_conformance.harness.outcomes import STATUS_TITLE
from fsdp_conformance.harness.protocol import RankOutcome

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b)")


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of a traceback: the file, the line and the function."""

    path: str
    line: int
    func: str

    @property
    def in_torch(self) -> bool:
        return "/torch/" in self.path.replace("\\", "/")

    def short(self) -> str:
        """``torch/distributed/fsdp/_fully_shard/_fsdp_state.py:_lazy_init`` (a torch or suite
        frame from its package folder; any other from its file name)."""
        path = self.path.replace("\\", "/")
        for package in ("/torch/", "/fsdp_conformance/"):
            if package in path:
                return f"{package[1:]}{path.rsplit(package, 1)[1]}:{self.func}"
        return f"{path.rsplit('/', 1)[-1]}:{self.func}"


@dataclasses.dataclass(frozen=True)
class RaisedError:
    """A Python traceback, read back from its text: the last exception and its frames."""

    type: str
    #: The exception's message (its first line; empty when it has none).
    message: str
    #: Outermost first, as Python prints them.
    frames: tuple[Frame, ...]

    @property
    def name(self) -> str:
        """The exception's class name without its module (``ValueError``)."""
        return self.type.rsplit(".", 1)[-1]

    def api(self) -> str:
        """Where it was raised: the innermost frame (a torch function where torch raised it,
        ``torch/distributed/fsdp/...py:function``; the user's or the suite's code where that
        raised it, even when called from torch); ``?`` without frames."""
        return self.frames[-1].short() if self.frames else "?"

    def passes_through(self, fragment: str) -> bool:
        return any(fragment in f.path.replace("\\", "/") for f in self.frames)


def parse_traceback(text: str) -> RaisedError | None:
    """The last exception of a traceback's text (a chained one's last part), or None where the
    text holds no ``Traceback (most recent call last):``."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call")]
    if not starts:
        return None
    frames: list[Frame] = []
    for ln in lines[starts[-1] + 1 :]:
        m = _FRAME.match(ln)
        if m:
            frames.append(Frame(m["path"], int(m["line"]), m["func"]))
            continue
        if ln.startswith((" ", "\t")) or not ln.strip():
            continue  # a frame's source line, its ^^^ markers
        head, _, message = ln.partition(":")
        if _EXCEPTION.match(head) or not message:
            return RaisedError(head.strip(), message.strip(), tuple(frames))
    return None


@dataclasses.dataclass(frozen=True)
class KnownError:
    """A torch error whose cause is known: how to recognise it and what to tell the user."""

    #: A short name (the tests' ids).
    name: str
    #: The exception's class name.
    type: str
    #: Matched against the exception's message (``re.search``): a stable part of torch's text.
    pattern: re.Pattern[str]
    #: A part of the path of a file the traceback must pass through (the API that raises it).
    through: str
    #: The API, in words, when it is better known by its public name than by its frame.
    api: str
    #: ``explain(match, params)``: what it means and the fix, in one sentence; ``params`` are
    #: the check's (its ``spec``, its ``version``).
    explain: Callable[[re.Match[str], Mapping[str, Any]], str]


def _split_tie(match: re.Match[str], params: Mapping[str, Any]) -> str:
    keep = tie_keeping_block_classes(params.get("spec"))
    fix = (
        f"pass --block-cls {','.join(keep)} (--fsdp-block-cls under pytest): those block "
        "classes keep every tie inside one unit"
        if keep
        else "pass --block-cls with block classes that hold both names of every tied "
        "parameter, or neither"
    )
    return (
        f"parameter {match['fqn']!r} is tied to a parameter in another FSDP unit: the block "
        f"classes split a tie, and FSDP2 refuses a parameter managed by two units; {fix}"
    )


def _fsdp1_input_dtype(match: re.Match[str], params: Mapping[str, Any]) -> str:
    return (
        f"a unit's inputs are not in its parameters' dtype ({match[0]}): FSDP1 casts the "
        "inputs of the root unit only, unless MixedPrecision(cast_forward_inputs=True) (FSDP2 "
        "casts each unit's inputs by default); a model that casts its inputs to a weight's dtype "
        "reads that weight while it is still the fp32 shard, and one that computes in fp32 "
        "between units hands fp32 on; fix: MixedPrecision(..., cast_forward_inputs=True)"
    )


def _fsdp2_batch_norm_dtype(match: re.Match[str], params: Mapping[str, Any]) -> str:
    return (
        f"a _BatchNorm's weight and bias are in {match['low']} while its running statistics "
        f"are fp32 ({match[0]}): FSDP2's MixedPrecisionPolicy casts parameters, not buffers, "
        "and CPU F.batch_norm refuses the mix; FSDP1's MixedPrecision keeps _BatchNorm modules "
        "in full precision by default, FSDP2 has no such default; fix: "
        "fully_shard(bn, mp_policy=MixedPrecisionPolicy()) on each _BatchNorm module before "
        "its parents"
    )


def _dcp_param_groups(match: re.Match[str], params: Mapping[str, Any]) -> str:
    saved = "FSDP1's" if params.get("version") == "fsdp1" else "the"
    return (
        f"torch behaviour, not a fault of the model: torch.distributed.checkpoint's load asks "
        f"for {match['key']!r} whole, though {saved} optimizer state dict was saved field by "
        "field: when a rank holds no shard of a parameter with fewer rows than ranks (ViT's "
        "class token, Qwen2-MoE's shared-expert gate), dcp.load's planner misses those keys on "
        "that rank and reads the files as a pre-2.4 checkpoint (docs/state.md)"
    )


#: The torch errors whose cause and fix are known, matched in order.
KNOWN_ERRORS: tuple[KnownError, ...] = (
    KnownError(
        "fsdp2-split-tie",
        "ValueError",
        re.compile(
            r"Parameter '(?P<fqn>[^']+)' is shared with a parameter already managed by "
            r"another FSDP group"
        ),
        "torch/distributed/fsdp/_fully_shard/",
        "fully_shard (FSDP2's lazy init)",
        _split_tie,
    ),
    KnownError(
        "fsdp1-input-dtype",
        "RuntimeError",
        re.compile(
            r"Input type \(\w+\) and (?:bias|weight) type \([\w:]+\) should be the same"
            r"|mat1 and mat2 must have the same dtype(?:, but got \w+ and \w+)?"
            r"|expected (?:m1 and m2|mat1 and mat2) to have the same dtype"
            r"|expected scalar type \w+ but found \w+"
        ),
        "torch/distributed/fsdp/fully_sharded_data_parallel.py",
        "FullyShardedDataParallel.forward",
        _fsdp1_input_dtype,
    ),
    KnownError(
        "fsdp2-batch-norm-dtype",
        "RuntimeError",
        re.compile(r"expected scalar type (?P<low>BFloat16|Half) but found Float"),
        "torch/nn/modules/batchnorm.py",
        "F.batch_norm (a _BatchNorm module's forward)",
        _fsdp2_batch_norm_dtype,
    ),
    KnownError(
        "fsdp1-dcp-optim-param-groups",
        "RuntimeError",
        re.compile(
            r"Missing key in checkpoint state_dict: (?P<key>optim\.param_groups[\w.]*?)\.?$"
        ),
        "torch/distributed/checkpoint/",
        "torch.distributed.checkpoint.load",
        _dcp_param_groups,
    ),
)


def known_error(error: RaisedError) -> KnownError | None:
    """The entry of :data:`KNOWN_ERRORS` that ``error`` is, or None."""
    for entry in KNOWN_ERRORS:
        if (
            error.name == entry.type
            and entry.pattern.search(error.message)
            and error.passes_through(entry.through)
        ):
            return entry
    return None


def explain(error: RaisedError, params: Mapping[str, Any]) -> str:
    """``ValueError in <api> (<innermost frame>): <what it means and the fix>`` (a known
    error), else ``<Type> in <innermost frame>: <its message>``."""
    entry = known_error(error)
    if entry is None:
        return f"{error.name} in {error.api()}: {error.message or '(no message)'}"
    match = entry.pattern.search(error.message)
    assert match is not None  # known_error matched it
    return f"{error.name} in {entry.api} ({error.api()}): {entry.explain(match, params)}"


def failure_line(outcomes: Sequence[RankOutcome], params: Mapping[str, Any]) -> str:
    """Every failed rank's story in one line: each distinct error once with the ranks that
    raised it, then the ranks that died, hung or never reported."""
    groups: dict[str, list[int]] = {}
    for o in sorted(outcomes, key=lambda o: o.rank):
        if o.status == "ok":
            continue
        if o.status == "error":
            error = parse_traceback(o.detail)
            text = explain(error, params) if error else _first_line(o.detail) or "raised"
        else:  # died, hung, never reported, left state behind; skipped alone
            text = STATUS_TITLE.get(o.status, o.status)
            why = re.sub(r"(; its (log ends|stacks))?:$", "", _first_line(o.detail))
            text += f" ({why})" if why else ""
            if o.status == "skip":
                text += " while other ranks did not"
        groups.setdefault(text, []).append(o.rank)
    parts = [
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {text}"
        for text, ranks in groups.items()
    ]
    return "; ".join(parts) or "every rank passed"


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")


def tie_keeping_block_classes(spec: Any) -> list[str] | None:
    """The names of ``spec``'s block classes that hold no tie split between a block and the
    rest of the model (built on meta), or None when none is left or the model cannot be built
    (a line about an error must not raise one of its own)."""
    from fsdp_conformance.models.model_spec import ModelSpec, ModelSpecError
    from fsdp_conformance.models.policies import PolicyError

    if not isinstance(spec, ModelSpec):
        return None
    try:
        built = spec.instantiate("meta")
        blocks = built.blocks
    except (ModelSpecError, PolicyError, RuntimeError, ValueError, TypeError):
        return None
    model = built.model
    names: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(fqn)
    ties = [fqns for fqns in names.values() if len(fqns) > 1]
    splitting: set[type] = set()
    for prefix, module in model.named_modules():
        for fqns in ties if prefix else ():
            inside = sum(f.startswith(prefix + ".") for f in fqns)
            if 0 < inside < len(fqns):
                splitting.update(cls for cls in blocks if isinstance(module, cls))
    keep = [cls.__name__ for cls in blocks if cls not in splitting]
    return keep or None
