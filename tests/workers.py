"""Started processes that the multi-process tests share: ``run`` is ``gpipe.launch`` without
the start-up of new processes on every call.

``gpipe.launch`` starts ``nprocs`` processes under torchrun's agent, each of which imports
torch and gpipe and joins a gloo group: seconds of work that prove nothing new after the
first time. Here the first ``run`` on ``nprocs`` processes launches them, with
``gpipe.launch`` itself, into a loop that takes one function at a time, and later calls
reuse them: the process group and the imports stay, while every test builds its own
pipelines, models and data. Each function runs in the caller's working directory as it is at
the call, as ``launch`` promises of the processes it starts. A function that fails on any
rank stops the whole group (its peers may be waiting for it) with a ``LaunchError`` that
names each rank's error, as ``launch`` does; the next ``run`` starts a fresh group.

The groups of every module fork from one server per pytest worker, which imported this module
(``start_forkserver``, at the start of each of xdist's workers): what the multi-process tests
of many modules build on, Hugging Face's model code and gpipe's splitting, is imported here
once, not in every process of every module's group (two seconds of CPU each).

Tests of start-up, shutdown or a dying peer call ``gpipe.launch`` and keep processes of
their own, and so do those of parameters tied across processes: torch names a group made
with ``use_local_synchronization`` after the number of groups each member already holds, so
a second pipeline whose ties span other ranks than the first's would wait forever.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import secrets
import signal
import socket
import threading
import traceback
from collections.abc import Callable, Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

import gpipe.splitting  # for the groups' server, as the docstring says
import gpipe.training.launch
from gpipe import LaunchError, launch
from gpipe.training.launch import threads_per_process

with contextlib.suppress(ImportError):  # the test extra installs transformers
    from transformers import LlamaForCausalLM  # noqa: F401  (for the server, as above)

TASK_TIMEOUT = 300.0  # seconds one function may take on a group before the group is stopped
START_TIMEOUT = 120.0  # seconds a new group's processes may take to call back
_pools: dict[int, _Pool] = {}


def serve(address: tuple[str, int], key: bytes) -> None:
    """What each shared process runs: connect back, then run functions until told to stop."""
    with Client(address, authkey=key) as conn:
        conn.send((int(os.environ["RANK"]), os.getpid()))
        while (task := conn.recv()) is not None:
            fn, args, threads, cwd = task
            os.chdir(cwd)
            if threads is not None:
                torch.set_num_threads(threads)
            try:
                conn.send(("ok", fn(*args)))
            except BaseException as exc:  # reported to the test, as launch reports it
                last = traceback.format_exception_only(exc)[-1].strip()
                conn.send(("error", last))


class _Pool:
    """``nprocs`` launched processes, each connected to this one."""

    def __init__(self, nprocs: int) -> None:
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), backlog=nprocs, authkey=key)
        self._failure: BaseException | None = None
        self._launched = threading.Thread(
            target=self._launch, args=(nprocs, self._listener.address, key), daemon=True
        )
        self._launched.start()
        # a launch that fails, or processes that never call back, must not leave the test
        # waiting in accept() for ever: either wakes it with a connection that closes at once
        late = threading.Timer(START_TIMEOUT, self._wake)
        late.start()
        found: dict[int, tuple[Connection, int]] = {}
        try:
            for _ in range(nprocs):
                conn = self._listener.accept()
                rank, pid = conn.recv()
                found[rank] = (conn, pid)
        except (OSError, EOFError, AuthenticationError):
            why = self._failure or f"{len(found)} of {nprocs} called back in {START_TIMEOUT:.0f} s"
            self._abandon(found)
            raise LaunchError(f"the shared processes did not start: {why}") from None
        finally:
            late.cancel()
        if sorted(found) != list(range(nprocs)):
            self._abandon(found)
            raise LaunchError(f"the shared processes called back as ranks {sorted(found)}")
        self._conns = [found[r][0] for r in range(nprocs)]
        self._pids = [found[r][1] for r in range(nprocs)]

    def _launch(self, nprocs: int, address: tuple[str, int], key: bytes) -> None:
        try:
            launch(serve, nprocs, (address, key), threads=None)
        except BaseException as exc:  # the group was stopped; close() reports nothing more
            self._failure = exc
            self._wake()

    def _abandon(self, found: dict[int, tuple[Connection, int]]) -> None:
        """A group that did not start: the processes that called back find their connection
        closed and end, and the launch with them."""
        for conn, _ in found.values():
            conn.close()
        self._listener.close()

    def _wake(self) -> None:
        """Connect and hang up: an ``accept()`` still waiting fails the handshake and returns;
        one already done leaves the connection unread until the listener closes."""
        with (
            contextlib.suppress(OSError),
            socket.create_connection(self._listener.address, timeout=1),
        ):
            pass

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], threads: int | None) -> dict:
        for conn in self._conns:
            conn.send((fn, args, threads, os.getcwd()))
        results, errors = {}, {}
        for rank, conn in enumerate(self._conns):
            if not conn.poll(TASK_TIMEOUT):
                errors[rank] = f"no answer after {TASK_TIMEOUT:.0f} s"
                break
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                errors[rank] = "the process ended"
                break
            (results if status == "ok" else errors)[rank] = value
        if errors:
            self.close(kill=True)
            lines = [f"rank {rank}: {text}" for rank, text in sorted(errors.items())]
            raise LaunchError("launched processes failed:\n" + "\n".join(lines))
        return results

    def close(self, kill: bool = False) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        if kill:
            for pid in self._pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._launched.join(timeout=30)
        for conn in self._conns:
            conn.close()
        self._listener.close()


def run(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    threads: int | str | None = "auto",
) -> dict[int, Any]:
    """``fn(*args)`` on each of ``nprocs`` shared processes; rank -> result, as ``launch``."""
    if threads == "auto":
        threads = threads_per_process(nprocs)
    pool = _pools.get(nprocs)
    if pool is None:
        pool = _pools[nprocs] = _Pool(nprocs)
    try:
        return pool.run(fn, args, threads)
    except LaunchError:
        del _pools[nprocs]
        raise


_scripts: dict[str, dict[str, Any]] = {}


def call_from_script(path: str, name: str, args: tuple[Any, ...]) -> Any:
    """``name(*args)`` of the script at ``path``: a function of a script (an example's, which
    a user's ``gpipe.launch`` pickles by its ``__main__`` name) on the shared processes, which
    run the script once each, under another name than ``__main__``."""
    if path not in _scripts:
        _scripts[path] = runpy.run_path(path, run_name="__gpipe_script__")
    return _scripts[path][name](*args)


@contextlib.contextmanager
def launching_on_shared_processes(script: str) -> Iterator[None]:
    """Inside it, ``gpipe.launch`` of a function of ``script`` runs it on the shared
    processes (``run``), as ``training_on_shared_processes`` does for `gpipe train`."""
    import gpipe

    started = gpipe.launch

    def launch(fn, nprocs, args=(), *, threads="auto", **more):
        if more:
            return started(fn, nprocs, args, threads=threads, **more)
        return run(call_from_script, nprocs, (script, fn.__name__, args), threads=threads)

    gpipe.launch = launch
    try:
        yield
    finally:
        gpipe.launch = started


@contextlib.contextmanager
def training_on_shared_processes(own: bool = False) -> Iterator[None]:
    """Inside it, `gpipe train` runs its stages on the shared processes (``run``) rather than
    starting new ones for every run (however it asks them started); runs that restart keep
    their own, and so do all with ``own``."""
    started = gpipe.training.launch.launch

    def launch(fn, nprocs, args=(), *, threads="auto", max_restarts=0, **more):
        if own or max_restarts or set(more) - {"start_method"}:
            return started(fn, nprocs, args, threads=threads, max_restarts=max_restarts, **more)
        return run(fn, nprocs, args, threads=threads)

    gpipe.training.launch.launch = launch
    try:
        yield
    finally:
        gpipe.training.launch.launch = started


def start_forkserver() -> None:
    """Start this process's forkserver now, preloading what ``gpipe.launch`` has it preload
    and this module. The server starts once, at the first launch, with what that launch has
    it preload: a test that launches a function of its own first would leave this module
    out, and every shared process of every later module would import it (Hugging Face's
    model code with it), two CPU seconds each, instead of forking from a server that did.
    So is what ``torch.compile`` imports at its first call (the graph compiler's modules,
    networkx among them: 1.5 CPU seconds in each process that compiles layers)."""
    import multiprocessing.forkserver

    compiler = "torch._inductor.compile_fx"  # torch.compile imports it lazily
    preload = ["torch", "torch._dynamo", compiler, "gpipe", "gpipe.training.launch", __name__]
    multiprocessing.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()


@atexit.register
def close_all() -> None:
    """Stop every shared group (at the end of the session)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close()
