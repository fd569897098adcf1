"""The public HTTP API (``/v1``)."""
