"""The node's root helper: every privileged host operation behind an allowlisted set of verbs.

The node agent never runs a privileged command itself; it asks for a *verb* (``net.create``,
``subvol.snapshot``, ...) with typed, validated arguments through a :class:`~.backend.Privileged`
backend. Two backends share one registry (:mod:`.verbs`):

- :class:`~.backend.InProcess` runs the verb in the calling process. It is for a process that is
  root anyway: the helper itself, the tests of the verbs, ``space node teardown``.
- the RPC client (:mod:`.rpc`) sends the verb to ``python -m space.node.helper`` over a unix socket
  that checks its peer's uid (``SO_PEERCRED``); the helper runs it as root.

A verb never takes a host path: its arguments are ids, indexes and pool-relative names, resolved
under roots the helper fixed at its start (``docs/notes/privilege-split.md``).
"""
