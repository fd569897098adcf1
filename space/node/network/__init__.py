"""Per-sandbox network namespaces, the egress gateway's life, the port proxy."""
