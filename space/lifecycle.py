"""The sandbox lifecycle: the only place that decides which transitions are allowed.

The API asks :func:`require` before accepting an action, the controller calls :func:`transition`
when it moves a sandbox, and the node agent reports live states that are checked here too. A
disallowed action raises :class:`~space.errors.InvalidState` naming the state and the actions the
state does allow.
"""

from __future__ import annotations

import enum

from space.errors import InvalidState


class State(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    RESTORING = "restoring"
    #: Being moved to another node (a drain): checkpointed here, restored there, then running
    #: (or paused) again as it was, processes and all.
    MOVING = "moving"
    TERMINATING = "terminating"
    TERMINATED = "terminated"
    FAILED = "failed"


class Action(enum.StrEnum):
    """What a client may ask of a sandbox (each maps to the states it is allowed in)."""

    EXEC = "exec"  # commands, files: anything that talks to the guest
    PAUSE = "pause"
    RESUME = "resume"
    SUSPEND = "suspend"
    RESTORE = "restore"
    SNAPSHOT = "snapshot"
    ROLLBACK = "rollback"
    FORK = "fork"
    DELETE = "delete"


S = State
A = Action

#: Allowed state changes: from -> {to}. ``failed`` may only be deleted.
TRANSITIONS: dict[State, frozenset[State]] = {
    S.CREATING: frozenset({S.RUNNING, S.FAILED, S.TERMINATING}),
    S.RUNNING: frozenset({S.PAUSED, S.SUSPENDING, S.TERMINATING, S.FAILED, S.RESTORING, S.MOVING}),
    S.PAUSED: frozenset({S.RUNNING, S.SUSPENDING, S.RESTORING, S.TERMINATING, S.FAILED, S.MOVING}),
    # A suspend that cannot finish puts the sandbox back as it was (running or paused).
    S.SUSPENDING: frozenset({S.SUSPENDED, S.RUNNING, S.PAUSED, S.FAILED, S.TERMINATING}),
    S.SUSPENDED: frozenset({S.RESTORING, S.TERMINATING}),
    # restoring covers every "new instance from a snapshot": restore, rollback, crash recovery.
    # A restore that fails leaves a suspended sandbox suspended (nothing half-restored).
    S.RESTORING: frozenset({S.RUNNING, S.SUSPENDED, S.FAILED, S.TERMINATING}),
    # A move ends in the state it started from (running or paused), on the new node or, when it
    # cannot finish, on the old one: nothing is lost either way.
    S.MOVING: frozenset({S.RUNNING, S.PAUSED, S.FAILED, S.TERMINATING}),
    S.TERMINATING: frozenset({S.TERMINATED, S.FAILED}),
    S.TERMINATED: frozenset(),
    S.FAILED: frozenset({S.TERMINATING}),
}

#: Which actions a state accepts.
ACTIONS: dict[State, frozenset[Action]] = {
    S.CREATING: frozenset({A.DELETE}),
    S.RUNNING: frozenset({A.EXEC, A.PAUSE, A.SUSPEND, A.SNAPSHOT, A.ROLLBACK, A.FORK, A.DELETE}),
    S.PAUSED: frozenset({A.RESUME, A.SUSPEND, A.SNAPSHOT, A.ROLLBACK, A.FORK, A.DELETE}),
    S.SUSPENDING: frozenset({A.DELETE}),
    S.SUSPENDED: frozenset({A.RESTORE, A.FORK, A.DELETE}),
    S.RESTORING: frozenset({A.DELETE}),
    S.MOVING: frozenset({A.DELETE}),
    S.TERMINATING: frozenset(),
    S.TERMINATED: frozenset(),
    S.FAILED: frozenset({A.DELETE}),
}

#: States in which the sandbox has (or is getting) a runtime instance on a node.
LIVE: frozenset[State] = frozenset({S.CREATING, S.RUNNING, S.PAUSED, S.SUSPENDING, S.RESTORING, S.MOVING})
#: States that never change again.
FINAL: frozenset[State] = frozenset({S.TERMINATED})


#: What a call that needs the guest does first in a state that has no guest running: an API call
#: to a paused or suspended sandbox resumes or restores it transparently (idle policy).
WAKE: dict[State, Action] = {S.PAUSED: A.RESUME, S.SUSPENDED: A.RESTORE}
#: Where each action that changes the sandbox's own state moves it.
ACTION_TARGET: dict[Action, State | None] = {
    A.EXEC: None,
    A.SNAPSHOT: None,
    A.FORK: None,  # makes other sandboxes
    A.PAUSE: S.PAUSED,
    A.RESUME: S.RUNNING,
    A.SUSPEND: S.SUSPENDING,
    A.RESTORE: S.RESTORING,
    A.ROLLBACK: S.RESTORING,
    A.DELETE: S.TERMINATING,
}


def allowed_actions(state: State) -> list[str]:
    return sorted(a.value for a in ACTIONS[state])


def can(state: State, action: Action) -> bool:
    return action in ACTIONS[state]


def require(state: State | str, action: Action) -> State:
    """Raise InvalidState unless ``action`` is allowed in ``state``."""
    st = State(state)
    if action not in ACTIONS[st]:
        raise InvalidState(
            f"cannot {action.value} a sandbox that is {st.value}",
            state=st.value,
            allowed=allowed_actions(st),
        )
    return st


def can_transition(src: State | str, dst: State | str) -> bool:
    return State(dst) in TRANSITIONS[State(src)]


def transition(src: State | str, dst: State | str) -> State:
    """Validate ``src -> dst``; return ``dst``. A no-op move (same state) is allowed (idempotency)."""
    s, d = State(src), State(dst)
    if s == d or d in TRANSITIONS[s]:
        return d
    raise InvalidState(
        f"cannot move a sandbox from {s.value} to {d.value}",
        state=s.value,
        allowed=allowed_actions(s),
    )
