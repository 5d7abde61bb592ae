"""FastAPI dependencies: the runtime, taken from the app state set by the lifespan."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.state import Runtime

__all__ = ["RuntimeDep", "get_runtime"]


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
