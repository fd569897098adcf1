"""The ``space`` command line (typer + rich), built on the sync SDK."""
