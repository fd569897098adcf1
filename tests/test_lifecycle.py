"""The sandbox state machine (space/lifecycle.py), driven by hypothesis.

- transition() accepts exactly TRANSITIONS (plus the same-state no-op), from enums or strings
- require() raises InvalidState naming the state and the allowed actions exactly when the action
  is not allowed; can()/can_transition() agree
- terminated is final; every state is reachable from creating; every state but terminated can
  reach terminated
- every action a state allows can be carried out by a transition out of that state
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from space.errors import InvalidState
from space.lifecycle import (
    ACTION_TARGET,
    ACTIONS,
    FINAL,
    TRANSITIONS,
    WAKE,
    Action,
    State,
    allowed_actions,
    can,
    can_transition,
    require,
    transition,
)


def reachable(src: State) -> set[State]:
    seen, todo = {src}, deque([src])
    while todo:
        for nxt in TRANSITIONS[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_tables_cover_every_state() -> None:
    assert set(TRANSITIONS) == set(State) == set(ACTIONS)


def test_every_state_reachable_from_creating() -> None:
    assert reachable(State.CREATING) == set(State)


@pytest.mark.parametrize("state", sorted(set(State) - {State.TERMINATED}))
def test_every_state_can_reach_terminated(state: State) -> None:
    assert State.TERMINATED in reachable(state)


def test_terminated_is_final() -> None:
    assert {State.TERMINATED} == FINAL
    assert TRANSITIONS[State.TERMINATED] == frozenset() and ACTIONS[State.TERMINATED] == frozenset()


def _state_arg(state: State, as_str: bool) -> State | str:
    return state.value if as_str else state


class Lifecycle(RuleBasedStateMachine):
    """One sandbox, pushed around by random actions and transitions (allowed or not)."""

    state: State

    @initialize()
    def created(self) -> None:
        self.state = State.CREATING
        self.visited = {State.CREATING}

    @rule(dst=st.sampled_from(list(State)), as_str=st.booleans())
    def move(self, dst: State, as_str: bool) -> None:
        ok = dst == self.state or dst in TRANSITIONS[self.state]
        assert can_transition(self.state, dst) == (dst in TRANSITIONS[self.state])
        if ok:
            got = transition(_state_arg(self.state, as_str), _state_arg(dst, as_str))
            assert got is dst
            self.state = dst
            self.visited.add(dst)
        else:
            with pytest.raises(InvalidState) as ei:
                transition(_state_arg(self.state, as_str), _state_arg(dst, as_str))
            assert ei.value.state == self.state.value
            assert ei.value.allowed == allowed_actions(self.state)

    @precondition(lambda self: self.state != State.TERMINATED)
    @rule(data=st.data())
    def allowed_step(self, data: st.DataObject) -> None:
        """Walk only legal edges, so that long runs reach the deep states too."""
        dst = data.draw(st.sampled_from(sorted(TRANSITIONS[self.state])))
        assert transition(self.state, dst) is dst
        self.state = dst
        self.visited.add(dst)

    @rule(action=st.sampled_from(list(Action)), as_str=st.booleans())
    def act(self, action: Action, as_str: bool) -> None:
        allowed = action in ACTIONS[self.state]
        assert can(self.state, action) == allowed
        if allowed:
            assert require(_state_arg(self.state, as_str), action) is self.state
        else:
            with pytest.raises(InvalidState) as ei:
                require(_state_arg(self.state, as_str), action)
            assert ei.value.state == self.state.value
            assert ei.value.allowed == sorted(a.value for a in ACTIONS[self.state])
            assert ei.value.code == "invalid_state" and ei.value.status == 409
            body = ei.value.to_wire()["error"]
            assert (body["state"], body["allowed"]) == (self.state.value, ei.value.allowed)

    @invariant()
    def terminated_is_final(self) -> None:
        if State.TERMINATED in self.visited:
            assert self.state == State.TERMINATED

    @invariant()
    def terminated_stays_reachable(self) -> None:
        assert State.TERMINATED in reachable(self.state)

    @invariant()
    def allowed_actions_can_be_carried_out(self) -> None:
        for action in ACTIONS[self.state]:
            target = ACTION_TARGET[action]
            assert target is None or target in TRANSITIONS[self.state], (self.state, action)


Lifecycle.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_lifecycle_machine = Lifecycle.TestCase


def test_wake_actions_are_allowed_and_lead_toward_running() -> None:
    for state, action in WAKE.items():
        assert action in ACTIONS[state]
        target = ACTION_TARGET[action]
        assert target is not None and State.RUNNING in reachable(target)
