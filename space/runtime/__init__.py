"""Runtime drivers: the one narrow interface between the node agent and whatever runs a sandbox."""
