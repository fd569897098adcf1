"""The node's btrfs pool, snapshots, and shipping them to and from object storage."""
