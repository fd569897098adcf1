"""The node agent's HTTP API (served on a unix socket or TCP) and the control plane's client of it."""
