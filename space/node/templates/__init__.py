"""Template specs, builds, saves and materialization on the node."""
