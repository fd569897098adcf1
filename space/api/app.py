"""The public API application."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from space.api import (
    apikeys,
    audit,
    commands,
    egress,
    files,
    lifecycle,
    metrics,
    nodes,
    pools,
    sandboxes,
    secrets,
    snapshots,
    templates,
    tenants,
)
from space.api.auditing import AuditMiddleware
from space.api.state import AppState
from space.web import install_error_handlers


def create_app(state: AppState) -> FastAPI:
    app = FastAPI(
        title="SPACE",
        version="1",
        description="Sandboxes for long-running AI agents. See docs/api.md.",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.space = state
    install_error_handlers(app)
    metrics.install(app)
    app.add_middleware(AuditMiddleware)
    for module in (sandboxes, lifecycle, snapshots, commands, files, templates, apikeys, nodes, pools,
                   secrets):
        app.include_router(module.router)
    for module in (tenants, audit, egress):
        app.include_router(module.router)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        nodes = await state.store.list_nodes("ready")
        return {"status": "ok", "nodes": len(nodes)}

    return app
