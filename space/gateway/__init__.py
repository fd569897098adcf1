"""The node's egress gateway: per-sandbox network policy, DNS, and credential injection."""
