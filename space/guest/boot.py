"""Entry point of the guest daemon inside a sandbox.

A script is always compiled from source, a module is loaded from its bytecode: this stub keeps the
daemon a module so that, with ``__pycache__`` compiled on the host (``space.node.main``), the guest
skips ~50 ms of compiling under gVisor. Standard library only.
"""

import sys

sys.path.insert(0, "/opt/space/guest")

import daemon  # type: ignore[import-not-found]

daemon.main()
