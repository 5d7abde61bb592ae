"""The chunk-size binding pipeline (docs/design.md s.2.2 rule 4).

Selecting a size binds it, in order, to every chunk-dependent part: each binding
does what its part needs for that size (check it can serve it, refuse it under live
sessions, publish it, join the deployment with it); operations never ask a part
for the size, ``app.chunk_size.ChunkSizeAuthority`` alone holds it. Each binding
runs at most once per selected size: after a failure the next ``run`` resumes at
the first binding that did not complete, and completed ones are not run again.
Only ``reset`` (a re-selection before the size is final) makes them pending again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contract.errors import BindingFailed, MPCacheError
from contract.schemas import BindingStatus

__all__ = ["Binding", "BindingPipeline"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Binding:
    name: str
    bind: Callable[[int], object]
    enabled: bool = True


class BindingPipeline:
    """Not thread-safe by itself: ``ChunkSizeAuthority`` serialises callers."""

    def __init__(self, bindings: Sequence[Binding]) -> None:
        names = [b.name for b in bindings]
        if len(set(names)) != len(names):
            raise ValueError(f"binding names must be unique: {names}")
        self._bindings = tuple(bindings)
        self._status: dict[str, BindingStatus] = {}
        self.reset()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self._bindings)

    def status(self) -> dict[str, BindingStatus]:
        return dict(self._status)

    def reset(self) -> None:
        self._status = {b.name: "pending" if b.enabled else "disabled" for b in self._bindings}

    def run(self, chunk_size: int) -> None:
        """Bind ``chunk_size`` to every binding not yet done; raise on the first failure."""
        for binding in self._bindings:
            if self._status[binding.name] in ("done", "disabled"):
                continue
            try:
                binding.bind(chunk_size)
            except Exception as exc:
                self._status[binding.name] = "failed"
                logger.warning(
                    "binding %r failed for chunk size %d: %s", binding.name, chunk_size, exc
                )
                # A domain error's fields (e.g. both sizes of a deployment conflict)
                # stay in the problem body.
                extras = exc.extras if isinstance(exc, MPCacheError) else {}
                raise BindingFailed(
                    f"binding {binding.name!r} failed for chunk size {chunk_size}: {exc}; "
                    "retry the negotiation, it resumes at this binding",
                    **extras,
                    binding=binding.name,
                    chunk_size=chunk_size,
                ) from exc
            self._status[binding.name] = "done"
            logger.debug("bound chunk size %d to %s", chunk_size, binding.name)
