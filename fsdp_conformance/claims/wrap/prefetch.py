"""``wrap.prefetch.forward`` / ``.backward`` / ``.coarse``: the order in which FSDP issues its
all-gathers, against block execution.

The user turns prefetch on with :func:`prefetch_options` (FSDP1's constructor arguments) and
:func:`prefetch_forward` (FSDP2's explicit forward prefetch); the faults of :data:`FAULTS`
patch those steps to leave prefetch off.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
from fsdp_conformance.claims.wrap.common import build, shard_with_policy
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec, call_model, default_loss
from fsdp_conformance.models.policies import PolicyName
from fsdp_conformance.models.units import ROOT, actual_units, clean_fqn

# --------------------------------------------------------------------------------------------
# The user's prefetch settings
# --------------------------------------------------------------------------------------------


def prefetch_options(version: str) -> dict[str, Any]:
    """FSDP1's prefetch arguments, both on: ``forward_prefetch=True``,
    ``backward_prefetch=BACKWARD_PRE``. FSDP2 takes none (its backward prefetch is on by
    default and has no public switch)."""
    if version != "fsdp1":
        return {}
    from torch.distributed.fsdp import BackwardPrefetch

    return {"forward_prefetch": True, "backward_prefetch": BackwardPrefetch.BACKWARD_PRE}


def prefetch_forward(unit_blocks: Sequence[Any]) -> None:
    """FSDP2's forward prefetch, asked explicitly: each block (an ``FSDPModule``) prefetches
    the next, ``unit_blocks`` in the order the forward runs them."""
    for current, following in itertools.pairwise(unit_blocks):
        current.set_modules_to_forward_prefetch([following])


def execution_order(run: Sequence[tuple[str, Any]]) -> list[int]:
    """The blocks (their indices in module order) in the order a recorded iteration's forward
    started them, each once: the order the user's FSDP2 forward prefetch follows, as torch
    itself records it for FSDP1 (its execution order, from the first iteration) and FSDP2 (its
    backward prefetch, from the forward's order). Module order is not execution order (blocks
    in a ``ModuleDict``, or run in reverse)."""
    return list(dict.fromkeys(i for kind, i in run if kind == "fwd_start"))


@contextlib.contextmanager
def _no_forward_prefetch(ctx: RankContext) -> Iterator[None]:
    with (
        patched_attr(
            __name__,
            "prefetch_options",
            lambda options: (
                lambda version: (
                    {**options(version), "forward_prefetch": False}
                    if version == "fsdp1"
                    else options(version)
                )
            ),
        ),
        patched_attr(__name__, "prefetch_forward", lambda ask: lambda unit_blocks: None),
    ):
        yield


def _without_backward(options: Callable[[str], dict[str, Any]]) -> Callable[[str], Any]:
    def no_backward(version: str) -> dict[str, Any]:
        if version != "fsdp1":
            raise ValueError(
                "FSDP2 has no public switch to turn backward prefetch off; "
                "use version='fsdp1' for that control"
            )
        return {**options(version), "backward_prefetch": None}

    return no_backward


def _no_backward_prefetch(ctx: RankContext) -> contextlib.AbstractContextManager[None]:
    return patched_attr(__name__, "prefetch_options", _without_backward)


def _module_order(original: Callable[[Sequence[tuple[str, Any]]], list[int]]) -> Any:
    def module_order(run: Sequence[tuple[str, Any]]) -> list[int]:
        return sorted(original(run))

    return module_order


FAULTS = FaultTable(
    module_order_prefetch=Fault(
        "FSDP2's forward prefetch set in module order, not in the order the forward runs the "
        "blocks: on a model that runs them in another order each block prefetches a unit that "
        "does not come next (FSDP1 follows its own recorded order: no change there)",
        lambda ctx: patched_attr(__name__, "execution_order", _module_order),
    ),
    no_forward_prefetch=Fault(
        "forward prefetch left off (FSDP1 forward_prefetch=False; FSDP2 no "
        "set_modules_to_forward_prefetch): the next unit is gathered only when its block starts",
        _no_forward_prefetch,
    ),
    no_backward_prefetch=Fault(
        "backward prefetch left off (FSDP1 backward_prefetch=None; FSDP2 has no switch and "
        "refuses it)",
        _no_backward_prefetch,
    ),
)

# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def record_unshards(events: list[tuple[str, Any]]) -> Iterator[None]:
    """Append ``("gather", key)`` whenever FSDP1 or FSDP2 issues a unit's all-gather.

    Wraps ``FlatParamHandle.unshard`` (FSDP1; recorded only when it really gathers) and
    ``FSDPParamGroup.unshard`` (FSDP2; recorded when it starts an all-gather). ``key`` is the
    handle or param group id, mapped to the unit by the caller.
    """
    handle_cls = _compat.fsdp1_flat_param_handle_cls()
    group_cls = _compat.fsdp2_param_group_cls()
    orig1, orig2 = handle_cls.unshard, group_cls.unshard

    def unshard1(self: Any) -> Any:
        if self.needs_unshard():
            events.append(("gather", id(self)))
        return orig1(self)

    def unshard2(self: Any, *args: Any, **kwargs: Any) -> Any:
        idle = self._all_gather_result is None and not self.is_unsharded
        out = orig2(self, *args, **kwargs)
        if idle and self._all_gather_result is not None:
            events.append(("gather", id(self)))
        return out

    handle_cls.unshard, group_cls.unshard = unshard1, unshard2
    try:
        yield
    finally:
        handle_cls.unshard, group_cls.unshard = orig1, orig2


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward calls a callback: the point where a block's backward ends."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, callback: Any) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.callback()
        return grad, None


def _mark_blocks(blocks: Sequence[tuple[str, nn.Module]], events: list[tuple[str, Any]]) -> None:
    """Hooks that append each block's forward start and end, and backward start and end."""
    for i, (_, block) in enumerate(blocks):

        def pre(mod: nn.Module, args: tuple[Any, ...], i: int = i) -> Any:
            events.append(("fwd_start", i))
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:
                # Marks the end of the block's backward *inside* its graph: a hook on the input
                # tensor itself would fire after FSDP's pre-backward hook of the previous unit
                # (registered on the same tensor), which gathers that unit prefetch or not.
                mark = functools.partial(events.append, ("bwd_end", i))
                return (_BackwardMark.apply(x, mark), *args[1:])  # type: ignore[no-untyped-call]
            return None

        def post(mod: nn.Module, args: tuple[Any, ...], out: Any, i: int = i) -> None:
            events.append(("fwd_end", i))
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g, i=i: events.append(("bwd_start", i)))

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def _fsdp1_handle_keys(sharded: nn.Module) -> dict[int, str]:
    """FSDP1 unit names by the identity of their flat-parameter handle."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return {
        id(_compat.fsdp1_handle(m)): clean_fqn(n)
        for n, m in sharded.named_modules()
        if isinstance(m, FSDP) and _compat.fsdp1_handle(m) is not None
    }


def _fsdp2_group_keys(sharded: nn.Module) -> dict[int, str]:
    """FSDP2 unit names by the identity of their param group (what ``record_unshards`` sees)."""
    keys = {}
    for n, m in sharded.named_modules():
        group = _compat.fsdp2_param_group(m)
        if group is not None:
            keys[id(group)] = n
    return keys


def _record_runs(
    sharded: nn.Module,
    batch: Any,
    events: list[tuple[str, Any]],
    keys: Mapping[int, str],
    iterations: int,
    after_first: Callable[[list[tuple[str, Any]]], None],
) -> list[list[tuple[str, Any]]]:
    """One event list per training iteration, gathers named by their unit; ``after_first`` is
    called with the first iteration's events."""
    runs: list[list[tuple[str, Any]]] = []
    for it in range(iterations):
        if it == 1:
            after_first(runs[0])
        events.clear()
        with record_unshards(events):
            out = call_model(sharded, batch)
            events.append(("fwd_done", None))
            default_loss(out).backward()
        runs.append(
            [(kind, keys.get(key, "?") if kind == "gather" else key) for kind, key in events]
        )
    return runs


# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class PrefetchResult(TypedDict):
    """What every rank of ``rank_prefetch`` reports."""

    rank: int
    version: str
    blocks: list[str]
    units: list[str]
    runs: list[list[tuple[str, Any]]]
    #: The blocks (indices into ``blocks``) in the order the first iteration's forward ran them.
    order: list[int]


def _shard_prefetching(
    model: nn.Module,
    ctx: RankContext,
    version: str,
    policy_obj: Any,
    blocks: Sequence[tuple[str, nn.Module]],
) -> tuple[nn.Module, dict[int, str]]:
    """``model`` sharded with prefetch on (FSDP1; FSDP2's forward prefetch is asked once the
    first iteration showed the blocks' order: :func:`_fsdp2_prefetch`), and its units by the key
    ``record_unshards`` sees."""
    sharded = shard_with_policy(model, ctx, version, policy_obj, **prefetch_options(version))
    if version == "fsdp1":
        return sharded, _fsdp1_handle_keys(sharded)
    return sharded, _fsdp2_group_keys(sharded)


def _fsdp2_prefetch(
    version: str, blocks: Sequence[tuple[str, nn.Module]]
) -> Callable[[list[tuple[str, Any]]], None]:
    """After the first iteration: FSDP2's forward prefetch in the order it ran the blocks, as
    users set it (torchtitan lists its layers in the order they run); FSDP1 nothing."""

    def ask(first: list[tuple[str, Any]]) -> None:
        if version == "fsdp2":
            fsdp_cls = _compat.fsdp_module_cls()
            ordered = [blocks[i][1] for i in execution_order(first)]
            prefetch_forward([m for m in ordered if isinstance(m, fsdp_cls)])

    return ask


def rank_prefetch(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    policy: PolicyName = "recommended",
    iterations: int = 2,
    fault: str | Sequence[str] | None = None,
) -> PrefetchResult:
    """Record all-gathers and block forward/backward start and end, per iteration.

    FSDP1: ``forward_prefetch`` and ``backward_prefetch=BACKWARD_PRE``. FSDP2: forward prefetch
    asked explicitly (``set_modules_to_forward_prefetch`` on each block with the next); its
    backward prefetch is on by default. ``fault``: names in :data:`FAULTS`.
    """
    with FAULTS.inject(fault, ctx):
        check_fsdp_version(version)
        if version == "fsdp1" and ctx.world_size == 1:
            skip_rank(
                "FSDP1 runs NO_SHARD at world size 1 (torch switches any sharding strategy "
                "to NO_SHARD): units are never gathered, so there is no prefetch to "
                "observe; run at world size >= 2 (FSDP2 still gathers at one rank)"
            )
        built = build(spec, ctx)
        model = built.model
        blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, built.blocks)]
        if len(blocks) < 2:
            # Same model on every rank, so every rank skips alike; with one block there is no
            # next unit, and the order verdicts would have nothing to examine.
            skip_rank(
                f"prefetch needs at least two blocks to observe an order; the model has "
                f"{len(blocks)}: use a config with two or more blocks"
            )
        events: list[tuple[str, Any]] = []
        _mark_blocks(blocks, events)
        sharded, keys = _shard_prefetching(model, ctx, version, built.policy(policy), blocks)
        batch = built.batch(batch_size=2, device=ctx.device)
        ask = _fsdp2_prefetch(version, blocks)
        runs = _record_runs(sharded, batch, events, keys, iterations, ask)
        return {
            "rank": ctx.rank,
            "version": version,
            "blocks": [n for n, _ in blocks],
            "units": [u.fqn for u in actual_units(sharded) if u.numel > 0],
            "runs": runs,
            "order": list(dict.fromkeys(i for kind, i in runs[0] if kind == "fwd_start")),
        }


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------


def _block_unit(block: str, units: Sequence[str]) -> str:
    """The innermost unit holding a block (the block itself with one unit per block)."""
    holders = [u for u in units if u == block or u == ROOT or block.startswith(u + ".")]
    return max(holders, key=len)


def _timeline(run: Sequence[tuple[str, Any]]) -> str:
    return " ".join(f"{k}:{v}" if v is not None else k for k, v in run)


def verdict_prefetch_forward(
    values: Sequence[PrefetchResult], params: Mapping[str, Any]
) -> Verdict:
    """In the last iteration, the unit of block k+1 is gathered before block k's forward ends."""
    return _judge_gather_order(values, "forward")


def verdict_prefetch_backward(
    values: Sequence[PrefetchResult], params: Mapping[str, Any]
) -> Verdict:
    """In backward, the unit of block k-1 is gathered before block k's backward ends."""
    return _judge_gather_order(values, "backward")


def _order_problems(v: PrefetchResult, direction: str) -> list[str]:
    """One rank's last iteration: each next block's unit gathered before the current block
    finished its ``direction``, next in the order the first iteration's forward ran the blocks
    (``order``; module order in a report without it)."""
    run = [tuple(e) for e in v["runs"][-1]]
    blocks, units = v["blocks"], v["units"]
    order = list(v.get("order") or range(len(blocks)))
    owners = [_block_unit(b, units) for b in blocks]
    if len(set(owners)) < len(blocks):
        return [
            f"rank {v['rank']}: blocks share units ({len(set(owners))} units for "
            f"{len(blocks)} blocks): there is no next unit to prefetch"
        ]
    if len(blocks) < 2:
        # No block pair to examine: passing here would prove nothing.
        return [
            f"rank {v['rank']}: fewer than two blocks ({len(blocks)}): no next unit whose "
            "gather order could be checked"
        ]
    problems = []
    done = run.index(("fwd_done", None))
    pairs = (
        [(k, nxt, ("fwd_end", k)) for k, nxt in itertools.pairwise(order)]
        if direction == "forward"
        else [(k, nxt, ("bwd_end", k)) for nxt, k in reversed(list(itertools.pairwise(order)))]
    )
    for k, nxt, end_event in pairs:
        if end_event not in run:
            problems.append(f"rank {v['rank']}: block {blocks[k]} never reported {end_event[0]}")
            continue
        end = run.index(end_event)
        window = run[:end] if direction == "forward" else run[done:end]
        if ("gather", owners[nxt]) not in window:
            problems.append(
                f"rank {v['rank']}: unit {owners[nxt]} was not gathered before "
                f"block {blocks[k]} finished its {direction}"
            )
    return problems


def _judge_gather_order(values: Sequence[PrefetchResult], direction: str) -> Verdict:
    """The forward or backward prefetch verdict: :func:`_order_problems` on every rank."""
    problems = [line for v in values for line in _order_problems(v, direction)]
    if problems:
        return Verdict(
            False,
            f"{direction} prefetch not in effect ({values[0]['version']}):\n  "
            + "\n  ".join(problems[:6])
            + "\n  timeline (rank 0, last iteration): "
            + _timeline(values[0]["runs"][-1]),
            {},
            {"runs": values[0]["runs"]},
        )
    return Verdict(
        True,
        f"{direction} prefetch in effect on every rank: each next block's unit "
        f"gathered before the current block finished",
        {},
        {"runs": values[0]["runs"]},
    )


def verdict_prefetch_coarse(values: Sequence[PrefetchResult], params: Mapping[str, Any]) -> Verdict:
    """With one coarse unit, one all-gather per iteration and none while blocks run."""
    problems = []
    for v in values:
        for it, run in enumerate(v["runs"]):
            gathers = [u for kind, u in run if kind == "gather"]
            if len(v["units"]) != 1 or len(set(gathers)) != 1:
                problems.append(
                    f"rank {v['rank']}, iteration {it}: {len(v['units'])} units, "
                    f"gathered {sorted(set(gathers))}: not a single coarse unit"
                )
                break
    if problems:
        return Verdict(
            False,
            "expected one coarse unit with nothing to prefetch:\n  " + "\n  ".join(problems[:4]),
            {},
            {},
        )
    return Verdict(
        True, "one coarse unit: a single all-gather per iteration, nothing to prefetch", {}, {}
    )
