"""Every route handler and every dependency of the API's apps (SPACE's and the E2B facade's three)
is a coroutine function.

FastAPI runs a plain ``def`` handler or dependency in its thread pool: a thread hop, and a wait for
a free worker under load, on every request that uses it. One such dependency (``app_state``, on
every route) cost about a tenth of the API's time per create in a burst of creates.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, APIWebSocketRoute

from space.api.app import create_app
from space.e2b.control import create_control_app
from space.e2b.envd import create_envd_app
from space.e2b.ports import create_ports_app
from tests.api.test_node_join import Api, api

__all__ = ["api"]


def _calls(dependant: Dependant) -> Iterator[Any]:
    if dependant.call is not None:
        yield dependant.call
    for sub in dependant.dependencies:
        yield from _calls(sub)


def _routes(routes: list[Any]) -> Iterator[APIRoute | APIWebSocketRoute]:
    for route in routes:
        if isinstance(route, APIRoute | APIWebSocketRoute):
            yield route
        inner = getattr(route, "original_router", None)  # an included router (FastAPI keeps it whole)
        if inner is not None:
            yield from _routes(inner.routes)


def _plain_functions(app: FastAPI) -> list[str]:
    found = []
    for route in _routes(app.routes):
        for call in _calls(route.dependant):
            if not inspect.iscoroutinefunction(call) and not inspect.isasyncgenfunction(call):
                found.append(f"{route.path}: {getattr(call, '__qualname__', call)!r}")
    return found


async def test_no_handler_or_dependency_runs_in_the_thread_pool(api: Api) -> None:
    apps = {"space": create_app(api.state), "e2b control": create_control_app(api.state),
            "e2b envd": create_envd_app(api.state), "e2b ports": create_ports_app(api.state)}
    routes = sum(len(list(_routes(app.routes))) for app in apps.values())
    assert routes > 100  # the walk saw the apps' routes
    plain = {name: found for name, app in apps.items() if (found := _plain_functions(app))}
    assert plain == {}
