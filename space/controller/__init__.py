"""The controller: operations, scheduling and reconciliation of desired vs live state."""

from space.controller.controller import Controller
from space.controller.nodes import NodeRegistry

__all__ = ["Controller", "NodeRegistry"]
