"""Starting K local processes for a one-machine run, on torchrun's elastic launcher."""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from gpipe.comm.process_group import finish_process_group
from gpipe.errors import PipelineError, StageError, counted, first_line

__all__ = ["LaunchError", "launch", "threads_per_process"]

_OWN_STORES = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # read by torchrun's c10d rendezvous
START_METHODS = ("forkserver", "spawn", "fork")
LOST_PEER_GRACE_S = 1.0  # how long a process that lost a peer waits before it ends

# The environment this module was imported with. In a process forked from the forkserver that
# is the server's, so what differs from it in a launched process is what torchrun's agent set.
_ENV_AT_IMPORT = dict(os.environ)


class LaunchError(PipelineError):
    """A launched process failed; the message carries each failed rank's error. ``signal``
    is the signal that interrupted the launch (Ctrl-C's SIGINT, a SIGTERM), else None."""

    def __init__(self, message: str, *, signal: int | None = None) -> None:
        super().__init__(message)
        self.signal = signal


def threads_per_process(local_processes: int) -> int:
    """Intra-op threads for each of ``local_processes`` processes sharing this machine: the
    cores this process may run on (its affinity mask, which containers and ``taskset``
    narrow), shared out evenly, at least one. Without this each process would start one
    thread per core and the processes would oversubscribe the machine."""
    if isinstance(local_processes, bool) or not isinstance(local_processes, int):
        raise ValueError(f"local_processes must be a positive integer, got {local_processes!r}")
    if local_processes < 1:
        raise ValueError(f"local_processes must be a positive integer, got {local_processes!r}")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // local_processes)


class _OwnStores:
    """Sets ``_OWN_STORES`` while any launch runs, from any number of threads at once, and
    puts the caller's value back when the last one ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._saved: str | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._running == 0:
                self._saved = os.environ.get(_OWN_STORES)
                os.environ[_OWN_STORES] = "1"
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    if self._saved is None:
                        os.environ.pop(_OWN_STORES, None)
                    else:
                        os.environ[_OWN_STORES] = self._saved


_own_stores = _OwnStores()


def _preload(fn: Callable[..., Any]) -> None:
    """Have the forkserver import torch, gpipe and ``fn``'s module once, so that a launched
    process starts as a fork of a process that has imported them and run nothing else,
    instead of importing them itself (seconds of CPU each). Takes effect when the server
    starts, at the first launch of this process. ``torch._dynamo`` is among them because
    every optimizer's constructor imports it (a second of CPU in each process)."""
    modules = ["torch", "torch._dynamo", "gpipe", __name__]
    module = getattr(fn, "__module__", None)
    if module == "__main__":
        modules += _installed_modules_of(sys.modules["__main__"])
    elif module:
        modules.append(module)
    multiprocessing.set_forkserver_preload(modules)


def _installed_modules_of(main: Any) -> list[str]:
    """The modules of installed packages that a script's names come from (``from
    transformers import GPT2LMHeadModel``: its modeling module): each launched process runs
    the script again, and would import them itself. The script's own modules are left to it
    (what they run on import stays in the processes that import them)."""
    found = []
    for value in vars(main).values():
        name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
        if not isinstance(name, str) or name == "__main__":
            continue
        path = getattr(sys.modules.get(name), "__file__", None) or ""
        if any(part in ("site-packages", "dist-packages") for part in Path(path).parts):
            found.append(name)
    return sorted(set(found))


@contextlib.contextmanager
def _main_without_pseudo_file() -> Iterator[None]:
    """A script read from standard input (``python - < script.py``) has ``"<stdin>"`` as its
    ``__main__.__file__``, which a process started by forkserver or spawn would try to run
    as a file, and fail: while processes start, such a main module names no file, as under
    ``python -c`` or in a notebook (whose main module the processes do not import)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    pseudo = isinstance(path, str) and path.startswith("<") and path.endswith(">")
    if main is None or not pseudo or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _take_environment(caller: Mapping[str, str]) -> None:
    """The caller's environment as it is now, with what torchrun's agent set on top: a
    forkserver's child inherits the server's, taken when the server started."""
    agent = {k: v for k, v in os.environ.items() if _ENV_AT_IMPORT.get(k) != v}
    for name in [k for k in os.environ if k not in caller and k not in agent]:
        del os.environ[name]
    os.environ.update(caller)
    os.environ.update(agent)


class _CallersStream:
    """The caller's stdout or stderr (file descriptor 1 or 2) as it is when a process is
    started: a forkserver's child would otherwise write where the server's went, which is
    where the caller's went when the server started (a test's captured output, a log file
    since redirected)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # duplicated for the child as the process is started (only then may it be)
        return (_DuplicatedStream, (self.fd, reduction.DupFd(self.fd)))


class _DuplicatedStream:
    def __init__(self, fd: int, duplicate: Any) -> None:
        self.fd, self._duplicate = fd, duplicate

    def install(self) -> None:
        """Write this process's ``fd`` where the caller's went."""
        (sys.stdout if self.fd == 1 else sys.stderr).flush()
        received = self._duplicate.detach()
        os.dup2(received, self.fd)
        os.close(received)


def _end_with_launcher(launcher: int) -> None:
    """End this process when the process that launched it ends: a launcher killed outright
    (SIGKILL, the out-of-memory killer) stops nothing, and the processes it started, children
    of the forkserver, would otherwise train on, unwatched, in a run folder that a restarted
    run then shares. The save in flight, if any, stays a ``.partial`` folder."""
    threading.Thread(
        target=_wait_for_end, args=(launcher,), name="gpipe-launcher-watch", daemon=True
    ).start()


def _wait_for_end(launcher: int) -> None:
    try:
        handle = os.pidfd_open(launcher)
    except ProcessLookupError:  # ended already
        pass
    except (AttributeError, OSError):  # no pidfd here (not Linux 5.3+): ask once a second
        while _alive(launcher):
            time.sleep(1.0)
    else:
        poller = select.poll()  # not select(): a descriptor past 1024 is fine
        poller.register(handle, select.POLLIN)  # readable once the launcher has ended
        poller.poll()
    rank = os.environ.get("RANK", "?")
    os.write(2, f"rank {rank}: its launcher (process {launcher}) ended; ending too\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the number: ours has ended
        return False
    return True


@record
def _entry(
    fn: Callable[..., Any],
    threads: int | None,
    caller: Mapping[str, str] | None,
    streams: tuple[_DuplicatedStream, ...],
    launcher: int,
    *args: Any,
) -> Any:
    _end_with_launcher(launcher)
    for stream in streams:
        stream.install()
    if caller is not None:
        _take_environment(caller)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        result = fn(*args)
    except StageError:
        # A peer was lost or stalled. The agent names the first process it sees end as the
        # failure: let the lost one be seen first (a forkserver relays its end a moment later
        # than the peer that noticed it would otherwise report its own).
        time.sleep(LOST_PEER_GRACE_S)
        raise
    _check_picklable(result, f"the result of {_name(fn)} on rank {os.environ.get('RANK')}")
    finish_process_group()
    return result


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _check_picklable(value: Any, what: str) -> None:
    """TypeError, naming ``what``, if ``value`` cannot cross to another process: pickling
    fails deep in torchrun's agent otherwise, reported without its reason."""
    try:
        reduction.ForkingPickler.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"{what} must be picklable to pass between processes (a module-level function, "
            f"plain data, tensors), got {type(value).__name__}: {first_line(exc)}"
        ) from None


def _reason(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    text = str(message).strip() or f"exit code {failure.exitcode}"
    return text.splitlines()[-1] if "Traceback" in text else text


def _checked_arguments(
    fn: Callable[..., Any],
    nprocs: object,
    args: object,
    threads: object,
    max_restarts: object,
    monitor_interval: object,
    start_method: object,
) -> int | None:
    """``launch``'s arguments refused, each naming itself, before anything starts; returns
    each process's thread count (``"auto"`` resolved)."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of fn's arguments, got {type(args).__name__}")
    if (
        isinstance(monitor_interval, bool)
        or not isinstance(monitor_interval, int | float)
        or not monitor_interval > 0
    ):
        raise ValueError(
            f"monitor_interval must be a positive number of seconds, got {monitor_interval!r}"
        )
    if threads == "auto":
        threads = threads_per_process(nprocs)
    elif threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ValueError(f"threads must be 'auto', None or a positive integer, got {threads!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative integer, got {max_restarts!r}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if start_method != "fork":  # the others pickle fn and args for each process
        _check_picklable(fn, f"fn ({_name(fn)})")
        _check_picklable(args, "args")
    return threads


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    threads: int | str | None = "auto",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    start_method: str = "forkserver",
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nprocs`` new processes on this machine; returns rank -> result.

    Each process finds torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so
    ``gpipe.Pipeline`` inside ``fn`` joins the process group by itself. ``fn`` must be
    importable by name (a module-level function). ``threads`` sets each process's intra-op
    thread count: ``"auto"`` (the default) shares this machine's cores among the processes
    (``threads_per_process``), an int sets it, None leaves PyTorch's default. If any process
    fails, the others are stopped; then torchrun's agent starts them all again, up to
    ``max_restarts`` times (each new process finds TORCHELASTIC_RESTART_COUNT above 0), and
    after that LaunchError names the failed ranks. A process that fails on losing a peer
    (``StageError``) ends a second later, so that the lost process is the one named. This
    process interrupted (SIGINT, SIGTERM) stops them and raises LaunchError naming the
    signal; killed outright, the processes it started end by themselves. ``fn``, ``args``
    and each result must be picklable (``fn`` and ``args`` need not, under ``"fork"``).

    ``start_method`` ``"forkserver"`` (the default, as in Python 3.14) forks each process
    from a server that imported torch and gpipe once, so processes start in a fraction of a
    second, restarts included; they see this process's working directory, ``sys.path``,
    environment, stdout and stderr as they are at the call. ``"spawn"`` starts each one from
    scratch; ``"fork"`` copies this process, which is only safe if it has run no multi-threaded
    torch work (OpenMP is not fork-safe).
    """
    threads = _checked_arguments(
        fn, nprocs, args, threads, max_restarts, monitor_interval, start_method
    )
    if start_method == "forkserver":
        _preload(fn)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"gpipe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
    )
    # The agent's store outlives a restart, and the addresses the lost processes left in it
    # would have the new ones connect to dead peers: each attempt gets a store of its own.
    # Without restarts the workers use the agent's store, whose port is already bound: a
    # store of their own goes on a port the agent found free, which another process may take
    # before it is bound.
    owning = _own_stores.held() if max_restarts > 0 else contextlib.nullcontext()
    with owning:
        forked = start_method == "forkserver"
        caller = dict(os.environ) if forked else None
        streams = (_CallersStream(1), _CallersStream(2)) if forked else ()
        try:
            with _main_without_pseudo_file():
                started = elastic_launch(config, _entry)
                return started(fn, threads, caller, streams, os.getpid(), *args)
        except ChildFailedError as exc:
            lines = [f"rank {rank}: {_reason(f)}" for rank, f in sorted(exc.failures.items())]
            raise LaunchError("launched processes failed:\n" + "\n".join(lines)) from None
        except SignalException as exc:  # the agent has stopped the processes
            name = signal.Signals(exc.sigval).name
            stopped = counted(nprocs, "launched process", "es")
            raise LaunchError(
                f"interrupted by {name}: stopped the {stopped}", signal=exc.sigval
            ) from None
