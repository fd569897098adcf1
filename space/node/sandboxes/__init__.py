"""A sandbox's life on the node: runtime instances, the warm pool, the guest channel, usage."""
