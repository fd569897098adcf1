"""The control plane's SQL store: SQLite embedded, PostgreSQL for several replicas.

``await Store.open(url)`` connects and migrates; every method is one short transaction and
returns detached rows of the models below.
"""

from space.store.models import (
    ApiKey,
    Node,
    Operation,
    OperationLog,
    Sandbox,
    SandboxEvent,
    Snapshot,
    Template,
    TemplateTag,
    WarmPool,
    new_snapshot,
)
from space.store.repo import Store

__all__ = ["ApiKey", "Node", "Operation", "OperationLog", "Sandbox", "SandboxEvent", "Snapshot",
           "Store", "Template", "TemplateTag", "WarmPool", "new_snapshot"]
