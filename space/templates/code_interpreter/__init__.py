"""The ``code-interpreter-v1`` template: its spec file and the server it runs (``server.py``,
copied into the template and run there by the template's own python, not imported here)."""
