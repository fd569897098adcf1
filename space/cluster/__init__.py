"""Cluster membership: the cluster CA, node certificates and join tokens."""
