"""Heartbeat: an asyncio loop in a daemon thread that watches the adapter's servers.

Never runs on vLLM's threads and is started lazily by the adapter (nothing starts at
import). Every ``interval_s`` it calls ``GET /health`` on each server with an
``httpx.AsyncClient``. A restart is detected two ways (docs/design.md s.3):

- an unhealthy -> healthy edge (the server was unreachable, or a call on vLLM's
  thread failed and marked it suspect), and
- a changed ``boot_id`` while the server looked healthy all along (a restart that
  happened between two pings).

Either way the server is (kept) unhealthy and the adapter's ``recover`` coroutine
runs: re-negotiate with the original alignment, require the exact cached chunk size,
re-register worker state. Only when it returns is the server marked healthy; if it
raises, the server stays unhealthy and recovery is tried again after the next
successful ping.

The same loop also runs work for the adapter that vLLM need not wait for, off vLLM's
thread: once (``submit``), or every so often (``every``: ending sessions, which a
step hands over without waking this thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence

import httpx

from connector.client import AsyncControlClient
from connector.config import ConnectorConfig
from connector.errors import ConnectorError
from connector.servers import ServerLink

__all__ = ["AsyncTransportFactory", "Heartbeat", "RecoverFn"]

logger = logging.getLogger("mpcache.connector")

RecoverFn = Callable[[ServerLink, AsyncControlClient], Awaitable[str]]
"""Re-join one server; returns the boot_id it joined, raises ConnectorError if not."""

AsyncTransportFactory = Callable[[str], httpx.AsyncBaseTransport | None]

Job = Callable[[Mapping[str, AsyncControlClient]], Awaitable[object]]


class Heartbeat:
    """Health loop for one adapter's servers (see module docstring)."""

    def __init__(
        self,
        links: Sequence[ServerLink],
        *,
        interval_s: float,
        timeout_s: float,
        recover: RecoverFn,
        name: str,
        transport_factory: AsyncTransportFactory | None = None,
        api_token: str | None = None,
    ) -> None:
        self.links = tuple(links)
        self._api_token = api_token
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        """Bound of each ping and recovery call: the configured timeout even when it
        is longer than the interval (a round ends before the next one starts). Cut
        to the interval, a busy server's slower answers read as failures, and a
        registration the server made after the cut was retried as a new one."""
        self._recover = recover
        self._name = name
        self._transport_factory = transport_factory
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._clients: dict[str, AsyncControlClient] = {}
        self._ready = threading.Event()
        self._stopping = False
        self._start_lock = threading.Lock()
        self._periodic: list[tuple[float, Job]] = []
        self.rounds = 0

    @classmethod
    def for_adapter(
        cls,
        links: Sequence[ServerLink],
        config: ConnectorConfig,
        *,
        recover: RecoverFn,
        name: str,
        transport_factory: AsyncTransportFactory | None = None,
    ) -> Heartbeat:
        """An adapter's heartbeat, timed and authenticated by its config (not started)."""
        return cls(
            links,
            interval_s=config.heartbeat_interval_s,
            timeout_s=config.heartbeat_timeout_s,
            recover=recover,
            name=name,
            transport_factory=transport_factory,
            api_token=config.api_token,
        )

    # ---------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the daemon thread once; later calls do nothing."""
        with self._start_lock:
            if self._thread is not None or self._stopping:
                return
            self._thread = threading.Thread(target=self._thread_main, name=self._name, daemon=True)
            self._thread.start()
        self._ready.wait(timeout=5.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and close its clients; safe to call more than once."""
        self._stopping = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            # The loop may close between the check and the call.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def wake(self) -> None:
        """Run a ping round now instead of at the next interval (thread-safe)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)

    def every(self, period_s: float, job: Job) -> None:
        """Run ``job(clients)`` on the loop every ``period_s`` while it runs, after
        each round of ``job`` ends (register before ``start``)."""
        if self._thread is not None:
            raise RuntimeError("periodic jobs are registered before the heartbeat starts")
        self._periodic.append((period_s, job))

    def submit(self, job: Job) -> concurrent.futures.Future[object] | None:
        """Run ``job(clients)`` on the loop; ``None`` if the loop is not running."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._stopping:
            return None
        try:
            return asyncio.run_coroutine_threadsafe(self._guard(job), loop)
        except RuntimeError:
            return None

    # ------------------------------------------------------------------- thread

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        except Exception:  # pragma: no cover - the loop body catches everything
            logger.exception("mpcache heartbeat %s crashed", self._name)
        finally:
            self._ready.set()
            loop.close()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake = asyncio.Event()
        self._clients = {
            link.url: AsyncControlClient(
                link.url,
                timeout_s=self.timeout_s,
                transport=self._transport_factory(link.url) if self._transport_factory else None,
                api_token=self._api_token,
            )
            for link in self.links
        }
        self._loop = loop
        self._ready.set()
        periodic = [loop.create_task(self._repeat(p, job)) for p, job in self._periodic]
        try:
            while not self._stopping:
                await self._round()
                self.rounds += 1
                if self._stopping:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.interval_s)
                self._wake.clear()
        finally:
            for task in periodic:
                task.cancel()
            await asyncio.gather(*periodic, return_exceptions=True)
            self._loop = None
            for client in self._clients.values():
                await client.aclose()

    async def _repeat(self, period_s: float, job: Job) -> None:
        while not self._stopping:
            await asyncio.sleep(period_s)
            await self._guard(job)

    async def _guard(self, job: Job) -> object:
        try:
            return await job(self._clients)
        except ConnectorError as exc:
            logger.debug("mpcache background call failed: %s", exc)
        except Exception:
            logger.exception("mpcache background call crashed")
        return None

    async def _round(self) -> None:
        await asyncio.gather(
            *(self._ping(link, self._clients[link.url]) for link in self.links),
            return_exceptions=True,
        )

    async def _ping(self, link: ServerLink, client: AsyncControlClient) -> None:
        try:
            health = await client.health()
        except ConnectorError as exc:
            link.mark_unhealthy(f"health check failed: {exc}")
            return
        if link.healthy and health.boot_id == link.boot_id:
            return
        if link.healthy:
            link.mark_unhealthy(f"server restarted: boot_id {link.boot_id} -> {health.boot_id}")
        try:
            boot_id = await self._recover(link, client)
        except ConnectorError as exc:
            link.note_recovery_failure(str(exc))
            return
        except Exception as exc:  # never let one bad recovery kill the loop
            logger.exception("mpcache recovery of %s crashed", link.url)
            link.note_recovery_failure(f"{type(exc).__name__}: {exc}")
            return
        link.mark_healthy(boot_id, recovered=True)
