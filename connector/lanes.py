"""The worker's transfers off vLLM's step: a lane is one thread running jobs in order.

``connector.worker`` hands each step's retrieve and store call to a lane of its own
(loads never queue behind stores) and returns to vLLM at once. What a job leaves
behind is read by vLLM's thread later, through the two ledgers here:

- ``LoadLedger``: a finished load's outcome (the request, and the blocks or the
  request that failed) is published in one piece under a lock, and taken in one
  piece, so vLLM never sees a load finished without the blocks that failed with it
  (vLLM reads ``get_transfer_results`` and then ``get_block_ids_with_load_errors``
  for the same step);
- ``StoreLedger``: which requests have stores queued or running, so a request's
  blocks are freed only once no store reads them (vLLM's delayed free: the
  scheduler holds a finished request's blocks until the worker reports it in
  ``finished_sending``), and which queued ops a preemption revoked.

A job never raises into its lane: what escapes is logged, and the job is marked
done, so nothing waits for it for ever. Every job ends because every call it makes
has a client timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

__all__ = ["Job", "Lane", "LoadLedger", "LoadOutcome", "StoreLedger"]

logger = logging.getLogger("mpcache.connector")


@dataclass(eq=False)
class Job:
    """One call on a lane, for the requests in ``request_ids``.

    ``revoked`` names requests whose part of the job must not be sent any more (a
    preemption freed their blocks before the job started); the job reads it, under
    its lane's lock, when it starts.
    """

    run: Callable[[Job], None]
    request_ids: frozenset[str]
    revoked: set[str] = field(default_factory=set)
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Lane:
    """A thread that runs ``Job``s in the order they were submitted."""

    def __init__(self, name: str, *, max_queued: int) -> None:
        self.name = name
        self._max_queued = max_queued
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._jobs: list[Job] = []  # submitted and not done, oldest first
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def lock(self) -> threading.Lock:
        """Held while a job is started and while ``revoke`` marks jobs."""
        return self._lock

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (nothing queued) when ``max_queued`` jobs wait to start."""
        with self._lock:
            waiting = sum(1 for j in self._jobs if not j.started)
            if waiting >= self._max_queued:
                return False
            self._jobs.append(job)
        self._queue.put(job)
        return True

    def revoke(self, request_ids: Collection[str]) -> list[Job]:
        """Revoke ``request_ids`` in the jobs not started yet; the started jobs that
        still run for any of them are returned (the caller waits for those)."""
        running: list[Job] = []
        with self._lock:
            for job in self._jobs:
                ids = job.request_ids.intersection(request_ids) - job.revoked
                if not ids:
                    continue
                if job.started:
                    running.append(job)
                else:
                    job.revoked.update(ids)
        return running

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every job submitted so far is done."""
        with self._lock:
            jobs = list(self._jobs)
        deadline = time.monotonic() + timeout_s
        return all(job.done.wait(max(0.0, deadline - time.monotonic())) for job in jobs)

    def close(self, timeout_s: float) -> None:
        """Run what is queued (bounded by ``timeout_s``), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            with self._lock:
                job.started = True
            try:
                job.run(job)
            except BaseException:  # a lane outlives any one job
                logger.exception("mpcache %s: a transfer failed unexpectedly", self.name)
            finally:
                with self._lock:
                    self._jobs.remove(job)
                job.done.set()


@dataclass
class LoadOutcome:
    """What one load job (or a step's unplanned loads) leaves for vLLM."""

    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)  # request-level (multi-group layouts)
    error_blocks: set[int] = field(default_factory=set)  # block-level (one group)


class LoadLedger:
    """Load outcomes from the lanes, taken by vLLM's thread in one piece."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._published = LoadOutcome()
        self._errors_taken: set[int] = set()

    def publish(self, outcome: LoadOutcome) -> None:
        with self._lock:
            self._published.finished |= outcome.finished
            self._published.failed |= outcome.failed
            self._published.error_blocks |= outcome.error_blocks

    def take(self) -> tuple[set[str], set[str]]:
        """(finished, failed) loads since the last call; their failed blocks are
        kept for the next ``take_errors``."""
        with self._lock:
            out, self._published = self._published, LoadOutcome()
        self._errors_taken |= out.error_blocks
        return out.finished, out.failed

    def take_finished(self) -> set[str]:
        """Finished loads that did not fail as a request (vLLM's older
        ``get_finished`` cannot report those: they stay for ``take``)."""
        with self._lock:
            out = self._published
            finished = out.finished - out.failed
            out.finished = set(out.failed)
            self._errors_taken |= out.error_blocks
            out.error_blocks = set()
        return finished

    def take_errors(self) -> set[int]:
        """The failed blocks of the loads ``take`` (or ``take_finished``) returned."""
        errors, self._errors_taken = self._errors_taken, set()
        return errors


class StoreLedger:
    """Which requests have stores in flight, and which finished requests to report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._seen: set[str] = set()  # every request a plan carried a store for
        self._finishing: set[str] = set()  # finished in vLLM, a store still running

    def planned(self, request_ids: Iterable[str]) -> None:
        """The plan carried stores for these requests (whether or not they run)."""
        with self._lock:
            self._seen.update(request_ids)

    def begin(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._in_flight[rid] = self._in_flight.get(rid, 0) + 1

    def end(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                left = self._in_flight.get(rid, 0) - 1
                if left > 0:
                    self._in_flight[rid] = left
                else:
                    self._in_flight.pop(rid, None)

    def in_flight(self, request_ids: Collection[str]) -> set[str]:
        with self._lock:
            return {rid for rid in request_ids if rid in self._in_flight}

    def finished(self, finished_req_ids: Collection[str]) -> set[str]:
        """Requests vLLM may free now: those of ``finished_req_ids`` (and of earlier
        calls) that had stores, once none of their stores is in flight. The
        scheduler delayed the free of exactly these (the same plans' stores)."""
        with self._lock:
            self._finishing.update(rid for rid in finished_req_ids if rid in self._seen)
            done = {rid for rid in self._finishing if rid not in self._in_flight}
            self._finishing -= done
            self._seen -= done
        return done
