"""``python -m space.gateway``: the node's egress gateway (run from the gateway's own venv)."""

from space.gateway.main import main

main()
