"""Every check starts from the same process state and leaves nothing behind (rank side).

:func:`clean_global_state` wraps each check on a rank: it snapshots what a check may change
(torch's module attributes, seeds, process-wide settings in :class:`_ProcessState`), restores it
afterwards, and reports what cannot be restored so the check that caused it fails.
"""

from __future__ import annotations

import _signal
import contextlib
import faulthandler
import functools
import gc
import logging
import os
import random
import signal
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def _guarded_namespaces() -> list[Any]:
    """Modules and classes whose attributes a check might monkeypatch; restored after each check."""
    import torch

    from fsdp_conformance._compat import GUARDED_TORCH_MODULES

    spaces: list[Any] = [sys.modules[n] for n in GUARDED_TORCH_MODULES if n in sys.modules]
    spaces += [torch.nn.Module, torch.Tensor]
    fsdp_mod = sys.modules.get("torch.distributed.fsdp")
    if fsdp_mod is not None and hasattr(fsdp_mod, "FullyShardedDataParallel"):
        spaces.append(fsdp_mod.FullyShardedDataParallel)
    if fsdp_mod is not None and hasattr(fsdp_mod, "FSDPModule"):
        spaces.append(fsdp_mod.FSDPModule)
    return spaces


#: Seconds a non-daemon thread started by a check gets to end after the check returned.
THREAD_GRACE_S = 1.0

#: The file faulthandler writes SIGUSR1 stack dumps to (set by the worker's ``main``); a check
#: that replaces the SIGUSR1 handler gets it re-registered, so the parent can still dump a hung
#: rank.
stacks_file: Any = None


@functools.lru_cache(maxsize=1)
def _torch_flags() -> tuple[tuple[str, Callable[[], Any], Callable[[Any], Any]], ...]:
    """Process-wide torch switches a check may flip: (name, getter, setter), built once."""
    import torch
    import torch.backends.cudnn
    import torch.backends.mkldnn
    import torch.backends.opt_einsum
    import torch.utils.deterministic

    b = torch.backends
    flags: list[tuple[str, Callable[[], Any], Callable[[Any], Any]]] = [
        ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
        (
            "torch.get_num_interop_threads()",
            torch.get_num_interop_threads,
            torch.set_num_interop_threads,
        ),
        (
            "torch.use_deterministic_algorithms",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
        (
            "torch.utils.deterministic.fill_uninitialized_memory",
            lambda: getattr(torch.utils.deterministic, "fill_uninitialized_memory", None),
            lambda v: setattr(torch.utils.deterministic, "fill_uninitialized_memory", v),
        ),
        (
            "torch.autograd.set_detect_anomaly",
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            lambda v: torch.autograd.set_detect_anomaly(v[0], check_nan=v[1]),
        ),
    ]

    def attr(space: Any, prefix: str, name: str) -> None:
        if hasattr(space, name):
            flags.append(
                (
                    f"{prefix}.{name}",
                    lambda: getattr(space, name),
                    lambda v: setattr(space, name, v),
                )
            )

    for name in ("enabled", "benchmark", "deterministic"):
        attr(b.cudnn, "torch.backends.cudnn", name)
    for name in ("enabled", "deterministic"):
        attr(b.mkldnn, "torch.backends.mkldnn", name)
    for name in ("enabled", "strategy"):
        attr(b.opt_einsum, "torch.backends.opt_einsum", name)
    attr(b, "torch.backends", "fp32_precision")
    for name in (
        "allow_fp16_reduced_precision_reduction",
        "allow_bf16_reduced_precision_reduction",
    ):
        attr(b.cuda.matmul, "torch.backends.cuda.matmul", name)
    for getter, setter in (
        ("flash_sdp_enabled", "enable_flash_sdp"),
        ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
        ("math_sdp_enabled", "enable_math_sdp"),
    ):
        if hasattr(b.cuda, getter) and hasattr(b.cuda, setter):
            flags.append(
                (
                    f"torch.backends.cuda.{getter}()",
                    getattr(b.cuda, getter),
                    getattr(b.cuda, setter),
                )
            )
    if hasattr(b, "mha") and hasattr(b.mha, "get_fastpath_enabled"):
        flags.append(
            (
                "torch.backends.mha.get_fastpath_enabled()",
                b.mha.get_fastpath_enabled,
                b.mha.set_fastpath_enabled,
            )
        )
    return tuple(flags)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@functools.lru_cache(maxsize=1)
def _signal_numbers() -> tuple[int, ...]:
    return tuple(int(sig) for sig in signal.valid_signals())


def _signal_handlers() -> dict[int, Any]:
    # _signal's getsignal skips signal's int-to-enum conversions: a tenth of the cost, and this
    # runs twice per check.
    getsignal = getattr(_signal, "getsignal", signal.getsignal)
    return {sig: getsignal(sig) for sig in _signal_numbers()}


def _default_group() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.group.WORLD


class _ProcessState:
    """What a check may change in this process beyond torch's module attributes.

    ``restore`` puts back what can be put back and returns a description of each change that
    cannot be (a live non-daemon thread, a destroyed process group, a setting torch refuses to
    change twice), so the check that made it fails instead of the next one.
    """

    def __init__(self) -> None:
        import torch

        self.threads = set(threading.enumerate())
        self.sys_lists = [
            (name, getattr(sys, name), getattr(sys, name)[:])
            for name in ("path", "meta_path", "path_hooks")
        ]
        self.recursion_limit = sys.getrecursionlimit()
        self.switch_interval = sys.getswitchinterval()
        self.streams = (sys.stdin, sys.stdout, sys.stderr)
        self.trace = (sys.gettrace(), sys.getprofile())
        self.gc = (gc.isenabled(), gc.get_threshold())
        root = logging.getLogger()
        self.log = (root.level, root.handlers[:], logging.root.manager.disable)
        self.umask = _umask()
        self.signals = _signal_handlers()
        self.itimer = signal.getitimer(signal.ITIMER_REAL)
        self.faulthandler = faulthandler.is_enabled()
        self.flags = [(name, get()) for name, get, _ in _torch_flags()]
        self.group = _default_group()
        self.cuda_device = (
            torch.cuda.current_device()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )

    def restore(self) -> list[str]:
        # Interpreter state first, then process-wide settings, then torch's; what cannot be
        # undone (torch flags, the process group, threads) is reported last, in that order.
        self._restore_sys()
        self._restore_gc_and_logging()
        if _umask() != self.umask:
            os.umask(self.umask)
        self._restore_signals()
        if self.itimer == (0.0, 0.0) and signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0):
            signal.setitimer(signal.ITIMER_REAL, 0)  # a pending alarm would fire mid-next-check
        if self.faulthandler and not faulthandler.is_enabled():
            faulthandler.enable(file=sys.stderr, all_threads=True)
        lost = self._restore_torch()
        lost += self._lost_group()
        lost += self._live_threads()
        return lost

    def _restore_sys(self) -> None:
        for name, original, before in self.sys_lists:
            # The original list, refilled: other code may hold a reference to it.
            if original != before:
                original[:] = before
            if getattr(sys, name) is not original:
                setattr(sys, name, original)
        if sys.getrecursionlimit() != self.recursion_limit:
            sys.setrecursionlimit(self.recursion_limit)
        if sys.getswitchinterval() != self.switch_interval:
            sys.setswitchinterval(self.switch_interval)
        if (sys.stdin, sys.stdout, sys.stderr) != self.streams:
            sys.stdin, sys.stdout, sys.stderr = self.streams
        if (sys.gettrace(), sys.getprofile()) != self.trace:
            sys.settrace(self.trace[0])
            sys.setprofile(self.trace[1])

    def _restore_gc_and_logging(self) -> None:
        enabled, threshold = self.gc
        if gc.get_threshold() != threshold:
            gc.set_threshold(*threshold)
        if gc.isenabled() != enabled:
            (gc.enable if enabled else gc.disable)()
        root = logging.getLogger()
        level, handlers, disable = self.log
        if root.level != level:
            root.setLevel(level)
        if root.handlers != handlers:
            root.handlers[:] = handlers
        if logging.root.manager.disable != disable:
            logging.disable(disable)

    def _restore_torch(self) -> list[str]:
        import torch

        lost: list[str] = []
        for (name, before), (_, get, set_) in zip(self.flags, _torch_flags()):
            if get() == before:
                continue
            changed_to = get()
            try:
                set_(before)
            except Exception:  # noqa: BLE001 - e.g. interop threads can be set once only
                pass
            if get() != before:
                lost.append(
                    f"it changed {name} from {before!r} to {changed_to!r}, which "
                    "torch cannot change back in this process"
                )
        if self.cuda_device is not None and torch.cuda.current_device() != self.cuda_device:
            torch.cuda.set_device(self.cuda_device)
        return lost

    def _lost_group(self) -> list[str]:
        lost: list[str] = []
        if self.group is not None:
            group = _default_group()
            if group is None:
                lost.append(
                    "it destroyed the default process group "
                    "(torch.distributed.destroy_process_group()); checks run on the "
                    "harness's group: leave it in place"
                )
            elif group is not self.group:
                lost.append(
                    "it replaced the default process group (destroyed it and called "
                    "init_process_group again); leave the harness's group in place"
                )
        return lost

    def _restore_signals(self) -> None:
        now = _signal_handlers()
        for sig, before in self.signals.items():
            if now.get(sig) is before:
                continue
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, before)
            if sig == signal.SIGUSR1 and stacks_file is not None:
                # signal.signal replaced faulthandler's own handler: install it again.
                faulthandler.unregister(signal.SIGUSR1)
                faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)

    def _live_threads(self) -> list[str]:
        new = [
            t
            for t in threading.enumerate()
            if t not in self.threads and not t.daemon and t is not threading.current_thread()
        ]
        deadline = time.monotonic() + THREAD_GRACE_S
        for t in new:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in new if t.is_alive()]
        if not alive:
            return []
        names = ", ".join(repr(n) for n in alive)
        return [
            f"it started non-daemon thread(s) still running {THREAD_GRACE_S:g}s after it "
            f"returned: {names}; stop and join them before returning (or make them daemons)"
        ]


@contextlib.contextmanager
def clean_global_state(seed: int = 0) -> Iterator[list[str]]:
    """Every check starts from the same state and leaves nothing behind.

    Seeds reset; default dtype and device, grad mode, environment, working directory and
    warning filters restored; attributes patched on torch's FSDP modules put back; so are the
    process-wide settings in :class:`_ProcessState` (threads counts, deterministic and anomaly
    modes, backend flags, ``sys.path``, recursion limit, root logging, umask, signal handlers).
    What cannot be put back (a live non-daemon thread, a destroyed process group) is appended,
    described, to the yielded list on exit, so the caller fails the check that caused it.
    fp32 matmuls and convolutions run in full fp32 (no TF32): the fp32 parity checks compare
    FSDP against an fp32 reference with fp32 tolerances (1e-5), which TF32's 10-bit mantissa
    would break on Ampere and later GPUs (cuDNN allows TF32 by default; a runner may enable
    it for cuBLAS).
    """
    import torch

    spaces = _guarded_namespaces()
    snapshots = [(space, dict(vars(space))) for space in spaces]
    process = _ProcessState()
    unrestorable: list[str] = []
    environ = dict(os.environ)
    cwd = os.getcwd()
    dtype = torch.get_default_dtype()
    matmul_precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    random.seed(seed)
    torch.manual_seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    torch.set_grad_enabled(True)
    try:
        with warnings.catch_warnings():
            yield unrestorable
    finally:
        torch.set_default_dtype(dtype)
        torch.set_float32_matmul_precision(matmul_precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        if hasattr(torch, "set_default_device"):
            torch.set_default_device(None)
        torch.set_grad_enabled(True)
        if os.getcwd() != cwd:
            os.chdir(cwd)
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
        for space, before in snapshots:
            _restore_namespace(space, before)
        unrestorable += process.restore()


#: Module attributes that are bookkeeping of state a check may leave (never restored):
#: process groups a check creates (a DeviceMesh's dimension groups) outlive it, and c10d names
#: the next group from ``_group_count``; restoring the count made the next check's ``new_group``
#: reuse a live group's name ("The specified group name has already been created").
NOT_RESTORED = {"torch.distributed.distributed_c10d": frozenset({"_group_count"})}


def _restore_namespace(space: Any, before: Mapping[str, Any]) -> None:
    now = vars(space)
    kept = NOT_RESTORED.get(getattr(space, "__name__", ""), frozenset())
    for key, value in before.items():
        if key in kept:
            continue
        if now.get(key, _MISSING) is not value:
            setattr(space, key, value)
    for key in [k for k in now if k not in before]:
        # Lazily imported submodules legitimately appear as new attributes: keep those.
        if not isinstance(now[key], types.ModuleType):
            delattr(space, key)


_MISSING = object()
