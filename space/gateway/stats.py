"""The gateway's counters (the control socket's ``stats``)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Stats:
    connections: int = 0  # client connections accepted from known sandboxes
    refused: int = 0  # client connections from unknown sources
    requests: int = 0  # plain-HTTP requests, CONNECTs and transparent connections decided
    denied: int = 0
    injected: int = 0  # requests that got a credential
    expired: int = 0
    rate_limited: int = 0
    bytes_up: int = 0  # from sandboxes
    bytes_down: int = 0  # to sandboxes
    dns_queries: int = 0
    dns_denied: int = 0
    dns_busy: int = 0  # queries refused at once: their sandbox (or all) had too many in flight
    dns_tcp_refused: int = 0  # DNS-over-TCP connections reset: too many open from that sandbox
    resets: int = 0  # connections aborted by ``reset``/``delete``/a policy change

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["bytes"] = self.bytes_up + self.bytes_down
        return out
