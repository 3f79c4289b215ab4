"""The rank side of the harness: one process per rank, started by :class:`RankPool`.

Run as ``python -m fsdp_conformance._worker SPEC``. It joins the process group through the
pool's file store, then loops: receive a check, run it from a clean global state, send back
``(task_id, status, value, detail, warnings)``. It never decides a check's outcome; the parent
does, from what every rank reports.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import os
import pickle
import random
import signal
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from fsdp_conformance import harness
from fsdp_conformance.harness import (
    _UNPICKLABLE_VALUE,
    CheckSkipped,
    RankContext,
    traceback_text,
)

#: Modules and classes whose attributes a check might monkeypatch; restored after each check.
_GUARDED = (
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
    "torch.distributed.fsdp.fully_sharded_data_parallel",
)


def _guarded_namespaces() -> list[Any]:
    import torch

    spaces: list[Any] = [sys.modules[name] for name in _GUARDED if name in sys.modules]
    spaces += [torch.nn.Module, torch.Tensor]
    fsdp_mod = sys.modules.get("torch.distributed.fsdp")
    if fsdp_mod is not None and hasattr(fsdp_mod, "FullyShardedDataParallel"):
        spaces.append(fsdp_mod.FullyShardedDataParallel)
    return spaces


@contextlib.contextmanager
def clean_global_state(seed: int = 0) -> Iterator[None]:
    """Every check starts from the same state and leaves nothing behind.

    Seeds reset; default dtype and device, grad mode, environment, working directory and
    warning filters restored; attributes patched on torch's FSDP modules put back. fp32 matmuls
    and convolutions run in full fp32 (no TF32): the fp32 parity checks compare FSDP against
    an fp32 reference with fp32 tolerances (1e-5), which TF32's 10-bit mantissa would break on
    Ampere and later GPUs (cuDNN allows TF32 by default; a runner may enable it for cuBLAS).
    """
    import torch

    spaces = _guarded_namespaces()
    snapshots = [(space, dict(vars(space))) for space in spaces]
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
            yield
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


def _restore_namespace(space: Any, before: Mapping[str, Any]) -> None:
    now = vars(space)
    for key, value in before.items():
        if now.get(key, _MISSING) is not value:
            setattr(space, key, value)
    for key in [k for k in now if k not in before]:
        # Lazily imported submodules legitimately appear as new attributes: keep those.
        if not isinstance(now[key], types.ModuleType):
            delattr(space, key)


_MISSING = object()


def _is_pytest_skip(exc: BaseException) -> bool:
    pytest = sys.modules.get("pytest")
    return pytest is not None and isinstance(exc, pytest.skip.Exception)


def execute_check(
    fn: Callable[..., Any], ctx: RankContext, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[str, Any, str, list[str]]:
    """Run one check on this rank: ``(status, value, detail, warnings)``."""
    caught: list[str] = []
    with clean_global_state():
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            try:
                value = fn(ctx, *args, **kwargs)
                status, detail = "ok", ""
            except CheckSkipped as exc:
                value, status, detail = None, "skip", str(exc)
            except BaseException as exc:  # noqa: BLE001 - every failure is reported, by rank
                if _is_pytest_skip(exc):
                    value, status, detail = None, "skip", str(getattr(exc, "msg", exc))
                else:
                    value, status, detail = None, "error", traceback_text(exc)
        for w in records:
            caught.append(f"{w.category.__name__}: {w.message}")
    return status, value, detail, caught


def _set_parent_death_signal() -> None:
    """Linux: die with the parent even if stuck in a collective (best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _init_process_group(spec: Mapping[str, Any]) -> RankContext:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = spec["backend"]
    rank, world_size = spec["rank"], spec["world_size"]
    local_rank = rank  # one machine: one device per rank
    kwargs: dict[str, Any] = {}
    if spec["device_type"] == "cuda":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{spec['store']}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=spec["pg_timeout"]),
        **kwargs,
    )
    return RankContext(rank, world_size, local_rank, backend, spec["device_type"])


def main(argv: Sequence[str]) -> None:
    from multiprocessing.connection import Client

    spec = ast.literal_eval(argv[0])
    _set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up
    faulthandler.enable(file=sys.stderr, all_threads=True)  # segfaults: Python stack in the log
    stacks = open(spec["stacks_path"], "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if spec.get("main_path"):
        _load_parent_main(spec["main_path"])
    conn = Client(spec["address"], family="AF_UNIX", authkey=bytes.fromhex(spec["authkey"]))
    conn.send({"rank": spec["rank"], "pid": os.getpid()})
    try:
        ctx = _init_process_group(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback_text(exc)))
        os._exit(1)
    conn.send(("ready", ""))
    while True:
        try:
            outer = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent is gone
        message = pickle.loads(outer)
        if message[0] == "stop":
            break
        _, task_id, inner = message
        try:
            fn, args, kwargs = pickle.loads(inner)
        except BaseException as exc:  # noqa: BLE001 - e.g. the test module fails to import here
            reply: tuple[Any, ...] = (
                task_id,
                "error",
                None,
                "could not load the check on this rank:\n" + traceback_text(exc),
                [],
            )
        else:
            reply = (task_id, *execute_check(fn, ctx, args, kwargs))
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - an unpicklable return value
            conn.send((task_id, "error", None, _UNPICKLABLE_VALUE.format(exc=exc), reply[4]))
    _shutdown()


def _load_parent_main(path: str) -> None:
    """Import the parent's script as ``__mp_main__`` (as multiprocessing's spawn does)."""
    import runpy

    harness._loading_parent_main = True
    try:
        namespace = runpy.run_path(path, run_name="__mp_main__")
    finally:
        harness._loading_parent_main = False
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__mp_main__"] = module
    sys.modules["__main__"] = module


def _shutdown() -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo sometimes aborts there (NOTES.md), and the results are in.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
