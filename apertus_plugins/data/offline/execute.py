"""Where the tasks of a run execute: in the driver's process, on local worker processes, or on Ray.

Every executor runs the same functions of :mod:`.worker` and gives the same bytes; only speed
differs. All three have :meth:`~Executor.map` (planning and merging: independent tasks with a
bounded number in flight) and :meth:`~Executor.batches` (the encode stage).

* :class:`InProcess` (``--workers 0``): one batch after another in the driver.
* :class:`LocalPool` (``--workers N``): ``N`` spawned processes, each decoding, encoding and
  writing whole batches; they exit when the driver dies (:mod:`.lifeline`).
* :class:`RayCluster` (``--ray-address ADDR``; ``local``: a head of the run's own, on loopback
  only, :mod:`.rayhead`): planning, decoding, writing and merging are Ray
  tasks (one CPU each); encoding runs on Ray actors (:class:`EncoderActor`) that load the encoders
  once and are fed shape-uniform batches that CPU tasks decoded and resized ahead of them: a
  bounded queue keeps up to two decoded batches per actor waiting, and every actor has up to two
  batches in flight, so the next one is on the actor when the current one finishes. With
  ``--device auto`` the actors take a GPU each when the cluster has GPUs (one actor per GPU),
  otherwise a CPU each (one actor per two CPUs, each running CPUs / actors intra-op threads; the
  other CPUs decode and write).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from apertus_plugins.data.offline import worker

from .plan import BatchRef

__all__ = ["RunError", "Executor", "InProcess", "LocalPool", "RayCluster", "make_executor", "EncoderActor"]

RESUME = "finished work is kept; run the same command again to resume"


def _submit_bounded(calls: Iterable[tuple[Any, tuple[Any, ...]]], submit: Callable[[tuple[Any, ...]], Any],
                    pending: dict[Any, Any], limit: int) -> Iterator[None]:
    """Keep at most ``limit`` of ``calls`` in flight: submit into ``pending`` (handle -> key), then yield
    while anything is pending, for the caller to collect (and remove) what finished."""
    it = iter(calls)
    more = True
    while more or pending:
        while more and len(pending) < limit:
            try:
                key, args = next(it)
            except StopIteration:
                more = False
                break
            pending[submit(args)] = key
        if not pending:
            return
        yield


class RunError(ValueError):
    """A run that cannot start or continue (another run holds the work dir, changed inputs, a failed task...)."""


class Executor(ABC):
    """The interface of the executors (see the module docstring); ``map`` and ``batches`` are abstract."""

    #: what runs in parallel: worker processes (local) or CPUs (Ray)
    workers: int = 1
    #: processes that run the encoders
    encoders: int = 1

    def device(self, wanted: str) -> str:
        """The encoder device a run with ``--device wanted`` uses here."""
        from .encode import resolve_device

        return resolve_device(wanted)

    @abstractmethod
    def map(self, fn: Callable[..., Any], calls: Iterable[tuple[Any, tuple[Any, ...]]],
            on_done: Callable[[Any, Any], None], what: str) -> None:
        """Run ``fn(*args)`` for every ``(key, args)``; ``on_done(key, result)`` as each finishes."""

    @abstractmethod
    def batches(self, work: str, refs: Iterable[BatchRef], on_done: Callable[[dict[str, Any]], None],
                encode: bool = True) -> None:
        """Run every batch; ``on_done(record)`` as each is committed (``encode``: the plan holds media)."""

    def close(self) -> None:  # noqa: B027 (optional hook: executors without resources keep nothing open)
        """Release the workers; nothing to release by default."""


class InProcess(Executor):
    workers = 0

    def map(self, fn: Callable[..., Any], calls: Iterable[tuple[Any, tuple[Any, ...]]],
            on_done: Callable[[Any, Any], None], what: str) -> None:
        for key, args in calls:
            on_done(key, fn(*args))

    def batches(self, work: str, refs: Iterable[BatchRef], on_done: Callable[[dict[str, Any]], None],
                encode: bool = True) -> None:
        for ref in refs:
            on_done(worker.run_batch(work, ref))


def _init_local(pgid: int, threads: int, driver: int) -> None:
    """A local worker process: it dies with the driver (:func:`.lifeline.exit_with_parent`: a killed
    driver leaves no worker behind), the run's process group (for the fault hook), its share of the CPUs."""
    from .lifeline import exit_with_parent

    exit_with_parent(driver)
    os.environ[worker.PGID_ENV] = str(pgid)
    os.environ["APERTUS_TOKENIZE_THREADS"] = str(threads)


class LocalPool(Executor):
    """``n`` spawned worker processes (the driver may have imported torch: forking it is unsafe).

    The workers end with the driver, however it ends (see :func:`_init_local`).
    """

    def __init__(self, n: int) -> None:
        self.workers = self.encoders = n
        self._pool = self._start()

    def _start(self) -> Any:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (os.cpu_count() or 1) // self.workers)
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_local, initargs=(os.getpgrp(), threads, os.getpid()))

    def map(self, fn: Callable[..., Any], calls: Iterable[tuple[Any, tuple[Any, ...]]],
            on_done: Callable[[Any, Any], None], what: str) -> None:
        from concurrent.futures import FIRST_COMPLETED, wait

        pending: dict[Any, Any] = {}
        for _ in _submit_bounded(calls, lambda args: self._pool.submit(fn, *args), pending, 2 * self.workers):
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for f in done:
                key = pending.pop(f)
                exc = f.exception()
                if exc is not None:
                    for p in pending:
                        p.cancel()
                    raise RunError(f"{what} {key} failed: {type(exc).__name__}: {exc} ({RESUME})") from exc
                on_done(key, f.result())

    def batches(self, work: str, refs: Iterable[BatchRef], on_done: Callable[[dict[str, Any]], None],
                encode: bool = True) -> None:
        """Every batch on the pool. A worker process that dies (a decoder's crash, an out-of-memory kill)
        takes the pool with it: the pool is started again and the batches that were in flight are run
        again item by item (:func:`.worker.run_batch_careful`), which finds and skips an item that kills
        its worker; only a batch whose workers keep dying with no item to blame fails the run."""
        from concurrent.futures import FIRST_COMPLETED, wait
        from concurrent.futures.process import BrokenProcessPool

        todo = iter(refs)
        again: deque[BatchRef] = deque()
        deaths: dict[int, int] = {}  # batch -> worker deaths while it was in flight
        pending: dict[Any, BatchRef] = {}
        while True:
            while len(pending) < 2 * self.workers:
                ref = again.popleft() if again else next(todo, None)
                if ref is None:
                    break
                fn = worker.run_batch_careful if ref.id in deaths else worker.run_batch
                pending[self._pool.submit(fn, work, ref)] = ref
            if not pending:
                return
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            died: list[BatchRef] = []
            for f in done:
                ref = pending.pop(f)
                exc = f.exception()
                if exc is None:
                    on_done(f.result())
                elif isinstance(exc, BrokenProcessPool):
                    died.append(ref)
                else:
                    raise RunError(f"batch {ref.id} failed: {type(exc).__name__}: {exc} ({RESUME})") from exc
            if not died:
                continue
            died += pending.values()  # the pool is gone: whatever was in flight goes again
            pending.clear()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = self._start()
            for ref in sorted(died, key=lambda r: r.id):
                deaths[ref.id] = deaths.get(ref.id, 0) + 1
                if deaths[ref.id] > worker.CRASHES * ref.items + 2:
                    raise RunError(f"batch {ref.id}: its worker process died {deaths[ref.id]} times, on no item in "
                                   f"particular ({RESUME})")
                again.append(ref)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class EncoderActor:
    """A Ray actor that holds the media encoders of one run (loaded once) and encodes decoded batches."""

    def __init__(self, work: str, threads: int) -> None:
        if threads:
            os.environ["APERTUS_TOKENIZE_THREADS"] = str(threads)
        self.work = work
        worker.context(work)  # the settings read once, the encoders on the first batch

    def encode(self, arrays: dict[str, Any]) -> Any:
        return worker.encode_batch(self.work, arrays)


class RayCluster(Executor):
    """Tasks and encoder actors on a Ray cluster (``address``: ``auto``, ``host:port``, ``ray://...``, ``local``).

    ``local`` starts a head for the run: on 127.0.0.1 only, with a token, ended with the run even when
    its driver is killed (:mod:`.rayhead`). The encoder actors are the run's own (not detached, not
    named): Ray ends them with the driver's job, and :meth:`batches` kills them when it returns.
    """

    def __init__(self, address: str, encoders: int = 0) -> None:
        import importlib.util

        from .rayhead import LocalHead, is_loopback, use_loopback

        if importlib.util.find_spec("ray") is None:
            raise RunError("--ray-address needs Ray: pip install 'apertus-plugins[ray]'")
        self._head: LocalHead | None = None
        if address == "local":  # a head of the run's own: loopback only, a token, gone with the run
            try:
                self._head = LocalHead.start()
            except RuntimeError as exc:
                raise RunError(f"--ray-address local: {exc}") from exc
            address = self._head.address
        elif is_loopback(address):
            use_loopback()
        import ray

        if self._head is not None and "ray._raylet" in sys.modules:  # Ray imported before: read the token mode
            with contextlib.suppress(Exception):
                sys.modules["ray._raylet"].Config.initialize("")
        env = {worker.PGID_ENV: str(os.getpgrp())}
        if os.environ.get(worker.FAULT_ENV):
            env[worker.FAULT_ENV] = os.environ[worker.FAULT_ENV]
        try:
            ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": env}, configure_logging=False)
        except BaseException:
            if self._head is not None:
                self._head.stop()
            raise
        self._ray = ray
        res = ray.cluster_resources()
        self.cpus = int(res.get("CPU", 1))
        self.gpus = int(res.get("GPU", 0))
        self.workers = max(1, self.cpus)
        self._wanted_encoders = encoders
        self.encoders = 1
        self._device = "cpu"

    def device(self, wanted: str) -> str:
        if wanted == "auto":
            self._device = "cuda" if self.gpus else "cpu"
        else:
            self._device = wanted
        if self._device.startswith("cuda") and not self.gpus:
            raise RunError(f"--device {wanted}: the Ray cluster has no GPU (use --device auto or cpu)")
        if self._device.startswith("cuda"):
            self._device = "cuda"  # each actor sees its own GPU as cuda:0
            self.encoders = self._wanted_encoders or self.gpus
        else:
            self.encoders = self._wanted_encoders or max(1, self.cpus // 2)
        return self._device

    def _wait(self, pending: dict[Any, Any], timeout: float | None = None) -> list[Any]:
        done, _ = self._ray.wait(list(pending), num_returns=1, timeout=timeout)
        return done

    def _get(self, ref: Any, what: str) -> Any:
        try:
            return self._ray.get(ref)
        except Exception as exc:
            raise RunError(f"{what} failed on the Ray cluster: {exc} ({RESUME})") from exc

    def map(self, fn: Callable[..., Any], calls: Iterable[tuple[Any, tuple[Any, ...]]],
            on_done: Callable[[Any, Any], None], what: str) -> None:
        task = self._ray.remote(num_cpus=1, max_retries=2)(fn)
        pending: dict[Any, Any] = {}
        for _ in _submit_bounded(calls, lambda args: task.remote(*args), pending, 2 * self.workers):
            for ref in self._wait(pending):
                key = pending.pop(ref)
                on_done(key, self._get(ref, f"{what} {key}"))

    def batches(self, work: str, refs: Iterable[BatchRef], on_done: Callable[[dict[str, Any]], None],
                encode: bool = True) -> None:
        ray = self._ray
        it: Iterator[BatchRef] = iter(refs)
        head = next(it, None)
        if head is None:
            return
        it = itertools.chain([head], it)
        cuda = self._device.startswith("cuda")
        n_actors = self.encoders if encode else 0
        free_cpus = self.cpus - (0 if cuda else n_actors)
        if free_cpus < 1:
            raise RunError(f"{self.encoders} CPU encoder actors leave no CPU of the cluster's {self.cpus} to decode "
                           "and write: pass a smaller --encoders")
        actor_cls = ray.remote(num_gpus=1, num_cpus=1)(EncoderActor) if cuda else \
            ray.remote(num_cpus=1)(EncoderActor)
        # a CPU actor reserves one CPU for the scheduler and runs the cluster's CPUs / actors intra-op threads:
        # decoding and writing are light next to encoding, and share the rest
        threads = 0 if cuda else max(1, self.cpus // max(1, n_actors))
        actors = [actor_cls.remote(work, threads) for _ in range(n_actors)]
        decode = ray.remote(num_cpus=1, max_retries=2, num_returns=2)(worker.decode_batch)
        write = ray.remote(num_cpus=1, max_retries=2)(worker.write_batch)
        depth = 2  # batches in flight per actor
        ahead = 2 * n_actors + free_cpus  # batches decoded (or being decoded) and not yet on an actor
        decoding: dict[Any, tuple[BatchRef, Any]] = {}
        ready: deque[tuple[BatchRef, Any, Any]] = deque()
        encoding: dict[Any, tuple[BatchRef, Any, int]] = {}
        writing: dict[Any, BatchRef] = {}
        load = [0] * len(actors)
        more = True
        try:
            while more or decoding or ready or encoding or writing:
                while more and len(decoding) + len(ready) < ahead:
                    try:
                        ref = next(it)
                    except StopIteration:
                        more = False
                        break
                    arrays, meta = decode.remote(work, ref)
                    decoding[meta] = (ref, arrays)
                while ready and load and min(load) < depth:
                    ref, arrays, meta = ready.popleft()
                    a = load.index(min(load))
                    load[a] += 1
                    encoding[actors[a].encode.remote(arrays)] = (ref, meta, a)
                pending = {**decoding, **encoding, **writing}
                if not pending:
                    continue
                for done in self._wait(pending):
                    if done in decoding:
                        ref, arrays = decoding.pop(done)
                        meta = self._get(done, f"batch {ref.id} (decoding)")
                        if isinstance(meta, dict):  # committed by an earlier run
                            on_done(meta)
                        elif any(keys for keys, _a in meta.arrays.values()):
                            ready.append((ref, arrays, done))
                        else:
                            writing[write.remote(work, done, None)] = ref
                    elif done in encoding:
                        ref, meta, a = encoding.pop(done)
                        load[a] -= 1
                        writing[write.remote(work, meta, done)] = ref
                    else:
                        ref = writing.pop(done)
                        on_done(self._get(done, f"batch {ref.id}"))
        finally:
            for a in actors:
                ray.kill(a)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ray.shutdown()
        if self._head is not None:
            self._head.stop()


def make_executor(workers: int, ray_address: str | None, encoders: int = 0) -> Executor:
    if ray_address:
        return RayCluster(ray_address, encoders)
    if workers == 0:
        return InProcess()
    return LocalPool(workers)

