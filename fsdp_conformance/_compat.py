"""The one place that touches torch's private or version-dependent APIs.

An upgrade that moves one of these breaks here, visibly, with a message naming what moved,
instead of deep inside a check. Everything else in the package imports from this module.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


class CompatError(RuntimeError):
    """A private torch API this suite relies on is missing from the installed torch."""


def _import(path: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError) as exc:
        raise CompatError(
            f"torch {torch.__version__} has no {path}.{name} ({exc}); fsdp-conformance needs "
            "an update for this torch: see fsdp_conformance/_compat.py"
        ) from None


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# -- FSDP1 wrap machinery (private: `_or_policy`, `_recursive_wrap`, `_Policy`) ----------------

_WRAP = "torch.distributed.fsdp.wrap"


def or_policy() -> Callable[..., bool]:
    return _import(_WRAP, "_or_policy")


def recursive_wrap() -> Callable[..., Any]:
    return _import(_WRAP, "_recursive_wrap")


def policy_base() -> type[Any]:
    return _import(_WRAP, "_Policy")


# -- FSDP1 unit internals ---------------------------------------------------------------------


def fsdp1_flat_param(unit: nn.Module) -> Any | None:
    """The FlatParameter of an FSDP1 unit, or None for a unit without parameters."""
    handle = getattr(unit, "_handle", None)
    if handle is None:
        return None
    return handle.flat_param


def fsdp1_unsharded_numel(flat_param: Any) -> int:
    return int(flat_param._unpadded_unsharded_size.numel())


def fsdp1_shard_padding(flat_param: Any) -> int | None:
    """The padding elements at the end of this rank's shard of an FSDP1 FlatParameter (private
    ``_shard_numel_padded``), or None where this torch does not keep it."""
    padded = getattr(flat_param, "_shard_numel_padded", None)
    return None if padded is None else int(padded)


def fsdp1_param_fqns(flat_param: Any) -> list[str]:
    """FQNs (relative to the unit's wrapped module) of the original parameters in a unit."""
    return list(flat_param._fqns)


def fsdp1_unsharded_allocated(flat_param: Any) -> bool | None:
    """Whether FSDP1 holds a unit's gathered flat parameter now (the storage of its padded
    unsharded ``_full_param_padded`` allocated: FSDP1 frees it when it reshards, keeps it when
    a strategy does not reshard after forward); None where torch has no such tensor (NO_SHARD
    never gathers, or a release that renamed it)."""
    padded = getattr(flat_param, "_full_param_padded", None)
    if not isinstance(padded, torch.Tensor):
        return None
    return padded.untyped_storage().size() > 0


def fsdp1_sharding_strategy(unit: nn.Module) -> str:
    handle = getattr(unit, "_handle", None)
    strategy = getattr(handle, "_sharding_strategy", None) or getattr(
        unit, "sharding_strategy", None
    )
    return getattr(strategy, "name", str(strategy))


def fsdp1_limit_all_gathers(model: nn.Module) -> bool | None:
    """The ``limit_all_gathers`` torch resolved for an FSDP1 unit (its undocumented state
    attribute ``limit_all_gathers``), or None when an upgrade renamed it. The limiter throttles
    CUDA streams: nothing to observe on CPU, so the defaults fingerprint reads what torch
    resolved."""
    value = getattr(model, "limit_all_gathers", getattr(model, "_limit_all_gathers", None))
    return None if value is None else bool(value)


# -- FSDP2 --------------------------------------------------------------------------------------


def _import_first(name: str, *paths: str) -> Any:
    """``name`` from the first of ``paths`` that has it; the error names the last one tried."""
    for path in paths[:-1]:
        try:
            return _import(path, name)
        except CompatError:
            pass
    return _import(paths[-1], name)


# torch < 2.6 kept FSDP2 under _composable, and DTensor under _tensor.
_FSDP2 = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
_DTENSOR = ("torch.distributed.tensor", "torch.distributed._tensor")


@functools.cache
def fully_shard() -> Callable[..., Any]:
    return _import_first("fully_shard", *_FSDP2)


@functools.cache
def fsdp_module_cls() -> type[Any]:
    return _import_first("FSDPModule", *_FSDP2)


@functools.cache
def mixed_precision_policy_cls() -> type[Any]:
    return _import_first("MixedPrecisionPolicy", *_FSDP2)


def cpu_offload_policy_cls() -> type[Any]:
    return _import_first("CPUOffloadPolicy", *_FSDP2)


def dtensor_cls() -> type[Any]:
    return _import_first("DTensor", *_DTENSOR)


# -- memory trackers (private `_tools`) -------------------------------------------------------


def mem_tracker_cls(global_peak_only: bool = True) -> type[Any] | None:
    """torch's ``MemTracker`` (any module), or None when an upgrade moved it.

    ``global_peak_only``: the class as :func:`_global_peak_only` makes it (the suite's meters);
    False: torch's class itself (the tests compare the two)."""
    try:
        cls = _import("torch.distributed._tools.mem_tracker", "MemTracker")
    except CompatError:
        return None
    return _global_peak_only(cls) if global_peak_only else cls


def fsdp_mem_tracker_cls(global_peak_only: bool = True) -> type[Any] | None:
    """torch's ``FSDPMemTracker`` (FSDP2, per-category), or None when an upgrade moved it;
    ``global_peak_only`` as for :func:`mem_tracker_cls`."""
    try:
        cls = _import("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker")
    except CompatError:
        return None
    return _global_peak_only(cls) if global_peak_only else cls


#: The attribute of a :func:`_global_peak_only` tracker holding each category's own peak since
#: it was last cleared: ``{device: {category: bytes}}`` (the most that category held after any
#: operator, whenever the total peaked). Absent where the tracker is torch's class as is.
CATEGORY_PEAKS = "_fsdp_conformance_category_peaks"


class _NoHook:
    """A hook handle that removes nothing (:func:`_global_peak_only`'s frozen parameters)."""

    def remove(self) -> None:
        return None


_NO_HOOK = _NoHook()


def _frozen_safe(cls: type[Any]) -> dict[str, Any]:
    """The member that lets a torch memory tracker enter a module of FSDP1 with
    ``use_orig_params=True``: torch registers a gradient hook and a post-accumulate hook on
    every parameter of a module it enters, and torch raises on a frozen one ("cannot register a
    hook on a tensor that doesn't require gradient") and on a non-leaf one ("post accumulate
    grad hooks cannot be registered on non-leaf tensors": FSDP1's views of its flat parameter
    during the step). Neither accumulates a gradient of its own (FSDP1 accumulates into the flat
    parameter): such a parameter is marked as hooked, with handles that remove nothing.
    ``{}`` where torch's method moved."""
    torch_track = getattr(cls, "_track_module_params_and_buffers", None)
    if torch_track is None:
        return {}

    def _track_module_params_and_buffers(
        self: Any, module: nn.Module, install_grad_hooks: bool = True
    ) -> Any:
        handles = getattr(self, "_param_to_grad_hook_handles", None)
        if install_grad_hooks and handles is not None:
            for param in module.parameters():
                hookable = param.requires_grad and param.is_leaf
                if not hookable and handles.get(param) is None:
                    handles[param] = (_NO_HOOK, _NO_HOOK)
        return torch_track(self, module, install_grad_hooks)

    return {"_track_module_params_and_buffers": _track_module_params_and_buffers}


@functools.cache
def _global_peak_only(cls: type[Any]) -> type[Any]:
    """``cls``, a torch memory tracker, updating only its global peak after each operator.

    torch's trackers call ``_update_peak_stats`` after every operator they see. It updates the
    global peak (``_peak_mem`` and ``_peak_mem_snap``: what ``get_tracker_snapshot("peak")``
    returns, the only figure the suite reads) and then walks every module the tracker has seen
    to update that module's own peak: O(modules) per operator, 30 to 40% of a rank's CPU in a
    tracked step of a four-layer transformers model (measured with py-spy), for per-module
    figures nothing here reads. The subclass keeps the global update as torch writes it and
    skips the walk; tests/test_meters.py checks that both classes give the same snapshots on the
    same step. Where an upgrade renames what the global update uses, the subclass calls torch's
    own method (correct, slower) and, where the method itself is gone, ``cls`` is used as is.
    It also lets the tracker enter a module holding a frozen parameter, which torch's raises on
    (its gradient hook; :func:`_frozen_safe`).
    """
    total_key = getattr(importlib.import_module(cls.__module__), "_TOTAL_KEY", None)
    torch_update = getattr(cls, "_update_peak_stats", None)
    if total_key is None or torch_update is None:
        return cls

    def _update_peak_stats(self: Any, peak_state: Any) -> None:
        try:
            current, peak, peak_snap = self._curr_mem_snap, self._peak_mem, self._peak_mem_snap
        except AttributeError:
            torch_update(self, peak_state)
            return
        for dev, dev_snap in current.items():
            if peak.get(dev, 0) < dev_snap[total_key]:
                peak[dev] = dev_snap[total_key]
                peak_snap[dev] = copy.deepcopy(dev_snap)
        # Each category's own peak (CATEGORY_PEAKS): the most it held at any operator.
        own = self.__dict__.setdefault(CATEGORY_PEAKS, {})
        for dev, dev_snap in current.items():
            mine = own.setdefault(dev, {})
            for key, value in dev_snap.items():
                if mine.get(key, 0) < value:
                    mine[key] = value

    members: dict[str, Any] = {"_update_peak_stats": _update_peak_stats, **_frozen_safe(cls)}
    return type(
        cls.__name__,
        (cls,),
        {
            **members,
            "__doc__": f"torch's {cls.__name__}, updating only its global peak after each operator.",
            "__module__": __name__,
            "__qualname__": f"_global_peak_only.<{cls.__name__}>",
        },
    )


def use_counts() -> Callable[[torch.Tensor], tuple[int, int]] | None:
    """``t -> (TensorImpl refs, StorageImpl refs)`` (private ``Tensor._use_count`` and
    ``torch._C._storage_Use_Count``), or None when an upgrade removed either. The memory checks
    use them to see when gloo's worker thread has let go of a collective's tensors."""
    storage_count = getattr(torch._C, "_storage_Use_Count", None)
    tensor_count = getattr(torch.Tensor, "_use_count", None)
    if storage_count is None or tensor_count is None:
        return None

    def counts(t: torch.Tensor) -> tuple[int, int]:
        return int(tensor_count(t)), int(storage_count(storage_key(t.untyped_storage())))

    return counts


# -- the fake process group (private `torch.testing._internal`) ------------------------------


def fake_store_cls() -> type[Any]:
    """``FakeStore``; importing its module registers the ``fake`` backend."""
    return _import("torch.testing._internal.distributed.fake_pg", "FakeStore")


# -- unshard (all-gather) observation, for the prefetch checks (private classes) -------------


def fsdp1_flat_param_handle_cls() -> type[Any]:
    """FSDP1's ``FlatParamHandle``: its ``unshard()`` issues a unit's all-gather."""
    return _import("torch.distributed.fsdp._flat_param", "FlatParamHandle")


def fsdp2_param_group_cls() -> type[Any]:
    """FSDP2's ``FSDPParamGroup``: its ``unshard()`` issues a unit's all-gather."""
    return _import("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup")


def fsdp2_param_group(module: nn.Module) -> Any | None:
    """The ``FSDPParamGroup`` of an FSDP2 unit, or None (no parameters, or not a unit)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    return getattr(get_state(), "_fsdp_param_group", None)


def fsdp2_param_groups(module: nn.Module) -> list[Any]:
    """Every ``FSDPParamGroup`` of an FSDP2 unit (torch 2.13: ``_fsdp_param_groups``, several
    with per-parameter meshes; older releases: ``_fsdp_param_group``, one or None)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


#: The torch functions inside which one unit's collectives are issued, each as (module path,
#: class name or None, attribute, position of the unit's torch object among the arguments):
#: FSDP1's ``FlatParamHandle.unshard`` (the handle's all-gather) and ``_runtime_utils``'
#: ``_reduce_grad`` / ``_reduce_grad_no_shard`` (``(state, handle)``: the handle's
#: reduce-scatter, all-reduce); FSDP2's ``FSDPParamGroup.unshard`` and ``.post_backward`` (the
#: group's all-gather; its reduce-scatter and HSDP all-reduce).
_UNIT_COLLECTIVE_SCOPES = (
    ("torch.distributed.fsdp._flat_param", "FlatParamHandle", "unshard", 0),
    ("torch.distributed.fsdp._runtime_utils", None, "_reduce_grad", 1),
    ("torch.distributed.fsdp._runtime_utils", None, "_reduce_grad_no_shard", 1),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup", "unshard", 0),
    (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "FSDPParamGroup",
        "post_backward",
        0,
    ),
)


def unit_collective_scopes() -> list[tuple[Any, str, int]]:
    """:data:`_UNIT_COLLECTIVE_SCOPES` as (owner, attribute, argument position), the owner a
    class or a module; one this torch lacks is left out (its collectives are then matched by
    size)."""
    out = []
    for path, cls_name, attr, position in _UNIT_COLLECTIVE_SCOPES:
        try:
            owner: Any = importlib.import_module(path)
        except ImportError:
            continue
        if cls_name is not None:
            owner = getattr(owner, cls_name, None)
        if owner is not None and callable(getattr(owner, attr, None)):
            out.append((owner, attr, position))
    return out


def fsdp2_state(module: nn.Module) -> Any | None:
    """The ``FSDPState`` ``fully_shard`` attached to ``module``, or None (not an FSDP2 unit).

    Several modules passed to one ``fully_shard([...])`` call share one state.
    """
    if not isinstance(module, fsdp_module_cls()):
        return None
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        raise CompatError(
            f"torch {torch.__version__}: an FSDPModule has no _get_fsdp_state(); "
            "fsdp-conformance reads FSDP2's managed parameters from it: see "
            "fsdp_conformance/_compat.py (fsdp2_state)"
        )
    return get_state()


def fsdp2_managed_params(
    state: Any,
) -> list[list[tuple[torch.Tensor, list[tuple[nn.Module, str]]]]]:
    """Per param group of an FSDP2 state: each managed parameter as torch holds it.

    Each entry is ``(sharded_param, [(module, attribute name), ...])``: the sharded DTensor the
    group owns, and every module attribute it is registered under (the first is the module it
    was found on, the others share it: a tied weight in a multi-module unit). Read from
    ``state._fsdp_param_groups`` (torch 2.13: a list, several groups per state with
    per-parameter meshes) or ``state._fsdp_param_group`` (older releases: one or None), then
    ``group.fsdp_params``, ``fsdp_param.sharded_param`` and ``fsdp_param._module_info``.
    """
    if hasattr(state, "_fsdp_param_groups"):
        groups = list(state._fsdp_param_groups)
    elif hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    else:
        raise CompatError(
            f"torch {torch.__version__}: FSDPState has neither _fsdp_param_groups nor "
            "_fsdp_param_group; fsdp-conformance reads FSDP2's units from them: see "
            "fsdp_conformance/_compat.py (fsdp2_managed_params)"
        )
    out = []
    for group in groups:
        rows = []
        try:
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                owners = [
                    (info.module, info.param_name),
                    *zip(info.shared_modules, info.shared_param_names),
                ]
                rows.append((fsdp_param.sharded_param, owners))
        except AttributeError as exc:
            raise CompatError(
                f"torch {torch.__version__}: FSDP2's param group moved ({exc}); "
                "fsdp-conformance reads fsdp_params, sharded_param and _module_info: see "
                "fsdp_conformance/_compat.py (fsdp2_managed_params)"
            ) from None
        out.append(rows)
    return out


def fsdp1_original_numels(flat_param: Any) -> list[int]:
    """Numels of the original parameters flattened into an FSDP1 FlatParameter (no padding)."""
    return [int(n) for n in flat_param._numels]


# -- attention on meta (private aten op), for activation plans ---------------------------------


def flash_attention_cpu_op() -> Callable[..., Any] | None:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (it has a meta kernel), or None.

    On meta, ``scaled_dot_product_attention`` falls back to the math path, which saves the
    full ``seq x seq`` attention weights for backward; the fused op saves what flash attention
    saves (q, k, v, output, logsumexp), as on GPU and in the CPU flash kernel.
    """
    packet = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return getattr(packet, "default", None) if packet is not None else None


def op_sac_kinds() -> dict[Any, str]:
    """The ops op-level selective activation checkpointing decides on, as torchtitan's policy
    names them (``_save_list`` in its ``apply_ac``), by op overload: ``aten.mm`` ("mm": every
    other one's output kept) and the fused attention ops ("attention": outputs always kept),
    the CPU flash op included (the planner's stand-in for the GPU one, and what CPU steps run).
    Ops this torch lacks are left out."""
    names = {
        "mm": "mm",
        "_scaled_dot_product_flash_attention": "attention",
        "_scaled_dot_product_efficient_attention": "attention",
        "_scaled_dot_product_cudnn_attention": "attention",
        "_scaled_dot_product_flash_attention_for_cpu": "attention",
    }
    kinds: dict[Any, str] = {}
    for name, kind in names.items():
        packet = getattr(torch.ops.aten, name, None)
        op = getattr(packet, "default", None) if packet is not None else None
        if op is not None:
            kinds[op] = kind
    return kinds


def grouped_mm_op() -> Any | None:
    """The op packet ``aten._grouped_mm`` (mixture-of-experts matmuls), or None.

    Its meta kernel repeats the CUDA kernel's dtype rule (bf16 only), while the CPU kernel also
    runs fp32: transformers' MoE experts call it in fp32 on CPU, so a meta forward of such a
    model fails where the real one runs (torch 2.13; see profile.py).
    """
    return getattr(torch.ops.aten, "_grouped_mm", None)


# -- tensor internals: pytree, dispatch modes, storage identity, views -------------------------


def tree_leaves(tree: Any) -> list[Any]:
    """Every leaf of a nested structure of lists, tuples, dicts (``torch.utils._pytree``)."""
    leaves: Callable[[Any], list[Any]] = _import("torch.utils._pytree", "tree_leaves")
    return leaves(tree)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf, the structure kept (``torch.utils._pytree``)."""
    mapped: Callable[..., Any] = _import("torch.utils._pytree", "tree_map")
    return mapped(fn, tree)


def torch_dispatch_mode_cls() -> type[Any]:
    """``TorchDispatchMode``: sees every aten op (``torch.utils._python_dispatch``)."""
    return _import("torch.utils._python_dispatch", "TorchDispatchMode")


def storage_key(storage: Any) -> int:
    """An identity for an untyped storage shared by every tensor viewing it (its C pointer)."""
    return int(storage._cdata)


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage (private ``Tensor._is_view``)."""
    return bool(t._is_view())


def process_group_ranks(value: Any) -> list[int] | None:
    """The global ranks of the process group a ``c10d`` op was called with, or None when
    ``value`` is not one. Inside a dispatch mode the group arrives as a ``torch.ScriptObject``
    (private: its ``_type()`` and ``ProcessGroup.unbox``); a torch that moved either records no
    group (None) rather than failing the step."""
    try:
        if not isinstance(value, torch.ScriptObject):
            return None
        if "ProcessGroup" not in value._type().qualified_name():
            return None
        import torch.distributed as dist

        return list(dist.get_process_group_ranks(dist.ProcessGroup.unbox(value)))
    except (AttributeError, RuntimeError, ValueError):
        return None


def fsdp1_handle(unit: nn.Module) -> Any | None:
    """The ``FlatParamHandle`` of an FSDP1 unit (its identity keys the unit's all-gathers)."""
    return getattr(unit, "_handle", None)


def fsdp1_mixed_precision_ignored_classes() -> tuple[type[nn.Module], ...]:
    """The module classes FSDP1's ``MixedPrecision`` keeps in full precision by default (its
    ``_module_classes_to_ignore``: ``(_BatchNorm,)`` in torch 2.13); () where it has none."""
    from torch.distributed.fsdp import MixedPrecision

    return tuple(getattr(MixedPrecision(), "_module_classes_to_ignore", ()) or ())


def fsdp1_compute_dtype(unit: nn.Module) -> torch.dtype | None:
    """The dtype an FSDP1 unit gathers and computes its flat parameter in (the handle's
    ``_fwd_bwd_param_dtype``: its ``MixedPrecision.param_dtype``, else the parameters' own);
    None: the unit owns no parameters."""
    handle = getattr(unit, "_handle", None)
    return None if handle is None else getattr(handle, "_fwd_bwd_param_dtype", None)


#: torch modules whose attributes a check might monkeypatch; the harness snapshots them before
#: each check and restores them after. Private FSDP modules are named here so that an upgrade
#: that moves them is seen in this one file.
GUARDED_TORCH_MODULES = (
    "torch",
    "torch.nn",
    "torch.nn.init",
    "torch.nn.modules.module",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.fsdp",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp._init_utils",
    "torch.distributed.fsdp._wrap_utils",
    "torch.distributed.fsdp._runtime_utils",
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives",
    "torch.distributed.fsdp._fully_shard._fsdp_param",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",
    "torch.distributed.fsdp._fully_shard._fsdp_state",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
)


def amp_unscale_op_name() -> str | None:
    """The name on ``torch`` of the fused check-and-unscale op ``GradScaler`` calls on each
    device's gradients (``torch._amp_foreach_non_finite_check_and_unscale_``, looked up at call
    time; DTensor all-reduces its found-inf), or None where this torch has none."""
    name = "_amp_foreach_non_finite_check_and_unscale_"
    return name if hasattr(torch, name) else None


# -- torch.compile (Dynamo's counters and backends; inductor's C++ compiler) -------------------


def dynamo_counters() -> dict[str, dict[str, int]] | None:
    """A copy of Dynamo's process-wide event counters (``torch._dynamo.utils.counters``:
    ``frames`` total/ok, ``stats`` unique_graphs/calls_captured, ``graph_break`` per reason),
    or None where this torch has none. They only grow (``torch.compiler.reset`` leaves them):
    read them before and after and take the difference."""
    try:
        counters = importlib.import_module("torch._dynamo.utils").counters
    except (ImportError, AttributeError):
        return None
    return {str(k): {str(n): int(c) for n, c in v.items()} for k, v in counters.items()}


def dynamo_backend(name: str) -> Callable[..., Any] | None:
    """The compiler function a ``torch.compile(backend=name)`` resolves to
    (``torch._dynamo.lookup_backend``), or None where this torch cannot look it up."""
    try:
        lookup = importlib.import_module("torch._dynamo").lookup_backend
    except (ImportError, AttributeError):
        return None
    return lookup(name)


def inductor_cpp_compilers() -> tuple[str, ...]:
    """The C++ compilers inductor's CPU backend tries (``torch._inductor.config.cpp.cxx``, its
    ``None`` meaning a conda-downloaded gcc dropped), falling back to ``$CXX`` or ``g++``."""
    import os

    try:
        cxx = importlib.import_module("torch._inductor.config").cpp.cxx
    except (ImportError, AttributeError):
        cxx = (os.environ.get("CXX", "g++"),)
    return tuple(str(c) for c in cxx if c)


def inductor_shutdown() -> None:
    """Stop inductor's compile workers (its process pools and the thread pool it keeps,
    ``torch._inductor.async_compile``), so a rank returns with no thread of inductor's still
    running; nothing where this torch has none of them."""
    try:
        module = importlib.import_module("torch._inductor.async_compile")
    except ImportError:
        return
    shutdown = getattr(module, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()
    pool = getattr(getattr(module, "AsyncCompile", None), "pool", None)
    if pool is not None and hasattr(pool, "cache_info") and pool.cache_info().currsize:
        pool().shutdown(wait=True)
        pool.cache_clear()


# -- Activation checkpointing (the public import users write has an underscore) ------------------

#: ``apply_activation_checkpointing`` / ``checkpoint_wrapper`` / ``CheckpointImpl``: documented in
#: torch's FSDP tutorials and used by torchtitan and accelerate, under a private module path.
_CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


def checkpoint_wrapper_module() -> Any:
    """The module holding ``apply_activation_checkpointing``, ``checkpoint_wrapper`` and
    ``CheckpointImpl`` (looked up by name at each call, so a fault may patch it)."""
    try:
        return importlib.import_module(_CHECKPOINT_WRAPPER)
    except ImportError as exc:
        raise CompatError(
            f"torch {torch.__version__} has no {_CHECKPOINT_WRAPPER} ({exc}); fsdp-conformance "
            "needs an update for this torch: see fsdp_conformance/_compat.py"
        ) from None


def checkpoint_wrapped_prefix() -> str:
    """The FQN component ``checkpoint_wrapper`` inserts (``_checkpoint_wrapped_module``)."""
    return str(getattr(checkpoint_wrapper_module(), "_CHECKPOINT_WRAPPED_MODULE", ""))


def dcp_checkpoint_prefix_owner() -> tuple[Any, str]:
    """Where ``torch.distributed.checkpoint.state_dict`` keeps the prefix it strips from the
    FQNs of a checkpoint-wrapped module: (its module, the attribute's name)."""
    return importlib.import_module("torch.distributed.checkpoint.state_dict"), "_CHECKPOINT_PREFIX"


def checkpoint_state_dict_hook_owner() -> tuple[type[Any], str]:
    """Where ``checkpoint_wrapper`` keeps the state-dict post hook that strips its FQN
    component from a model's keys: (the wrapper's base class, the static method's name)."""
    return checkpoint_wrapper_module().ActivationWrapper, "_post_state_dict_hook"
