"""This control-plane process's identity towards nodes: a client certificate it mints from the
cluster CA at start and mints again when half its life is gone, so a process that runs for months
never presents an expired one, and a leaked one is short-lived."""

from __future__ import annotations

import socket
import ssl
import time

from space.cluster.pki import ClusterCA, client_context

#: A minted certificate lives this long, and is replaced after half of it.
CLIENT_CERT_DAYS = 30


class ControlPlaneTLS:
    def __init__(self, ca: ClusterCA, role: str, *, days: int = CLIENT_CERT_DAYS) -> None:
        self.ca = ca
        # The name is for the nodes' logs: which kind of process, on which machine.
        self.name = f"{role}-{socket.gethostname()}"[:50].strip(".-_") or role
        self.days = days
        #: Grows by one whenever the certificate is replaced (clients built on an older one are rebuilt).
        self.generation = 0
        self._context: ssl.SSLContext | None = None
        self._renew_at = 0.0

    def context(self) -> ssl.SSLContext:
        now = time.monotonic()
        if self._context is None or now >= self._renew_at:
            cert, key = self.ca.issue_client(self.name, days=self.days)
            self._context = client_context(cert, key, self.ca.cert_pem)
            self._renew_at = now + self.days * 86400 / 2
            self.generation += 1
        return self._context
