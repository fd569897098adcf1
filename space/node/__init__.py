"""Node-local services: the node agent, its storage (btrfs pool, templates) and sandbox manager."""
