"""The machine that decides: one ``transitions.Machine`` per policy, built once.

Its states are ``start``, the policy's steps in order, and the terminal states.
It has one trigger, ``advance``. From a step, the ordered transitions first
conclude (to ``selected``, ``fallback_none`` or ``failed``, when the step has
resolved the decision), then lead to each later step in the policy's order,
with that step's guard as the condition. ``transitions`` evaluates the
conditions in order and takes the first that holds, so skipping a step is its
guard failing, and every evaluation is recorded by the guard itself. Entering
a step runs its action. Nothing here names a family or a profile: a policy's
steps are its machine.
"""

from __future__ import annotations

from functools import lru_cache

from transitions import Event, EventData, Machine, Transition

from moe_fsm.fsm.policy import FAILED, FALLBACK_NONE, SELECTED, START, TERMINAL_STATES, FamilyPolicy

CONCLUSIONS = (
    (SELECTED, "a backend's verdict is supported",
     lambda event: event.model.selection is not None and event.model.selection.status == SELECTED),
    (FALLBACK_NONE, "nothing applies on this vendor: the platform's own MoE path",
     lambda event: event.model.selection is not None and event.model.selection.status == FALLBACK_NONE),
    (FAILED, "an error was raised", lambda event: event.model.error is not None),
)


class GuardedTransition(Transition):
    """transitions' Transition for a machine whose conditions and callbacks are all plain callables.

    ``execute`` keeps transitions' semantics (every condition must return its
    target, then the state changes, then the ``after`` callbacks run) without
    what this machine does not use and a decision should not pay for on every
    guard: debug logging, callback-name resolution, before/prepare hooks and
    state enter/exit callbacks (its states have none).
    """

    def execute(self, event_data) -> bool:
        for condition in self.conditions:
            if condition.func(event_data) != condition.target:
                return False
        machine = event_data.machine
        dest = machine.states[self.dest]
        setattr(event_data.model, machine.model_attribute, dest.value)
        event_data.state = dest
        for callback in self.after:
            callback(event_data)
        return True


class DecisionEvent(Event):
    """transitions' Event for this machine: ``advance`` is processed at once.

    ``Event.trigger`` hands its work to ``Machine._process`` (for queued
    machines) and runs the machine's prepare, finalize and exception callbacks
    with debug logging around them. This machine has no queue and none of those
    callbacks (``machine_for`` checks), so here they only cost each step a few
    microseconds. What is kept is what decides: the current state's transitions
    tried in their order, the first whose conditions all hold taken, and a
    state with no way out is transitions' MachineError.
    """

    def trigger(self, model, *args, **kwargs) -> bool:
        event_data = EventData(None, self, self.machine, model, args=args, kwargs=kwargs)
        event_data.state = state = self.machine.get_model_state(model)
        if self._is_valid_source(state):
            for transition in self.transitions[state.name]:
                event_data.transition = transition
                if transition.execute(event_data):
                    event_data.result = True
                    break
        return event_data.result


class DecisionMachine(Machine):
    transition_cls = GuardedTransition
    event_cls = DecisionEvent


def _entered(event) -> None:
    event.model.entered(event)


def _acting(step):
    def act(event) -> None:
        event.model.act(step)
    return act


def _guarded(step):
    def holds(event) -> bool:
        return step.guard(event.model)
    return holds


def _transitions(policy: FamilyPolicy) -> list[dict]:
    steps = policy.steps
    out = []
    for index, source in enumerate([None, *steps]):
        source_name = START if source is None else source.name
        if source is not None:
            for dest, _, condition in CONCLUSIONS:
                out.append({"trigger": "advance", "source": source_name, "dest": dest,
                            "conditions": condition, "after": _entered})
        for step in steps[index:]:
            out.append({"trigger": "advance", "source": source_name, "dest": step.name,
                        "conditions": _guarded(step), "after": [_entered, _acting(step)]})
    return out


@lru_cache(maxsize=None)
def machine_for(policy: FamilyPolicy) -> Machine:
    """The policy's machine; decision models are driven through it without being added to it."""
    names = [s.name for s in policy.steps]
    if len(set(names)) != len(names):
        raise ValueError(f"the {policy.label} policy names a step twice: {names}")
    machine = DecisionMachine(
        model=None,
        states=[START, *names, *TERMINAL_STATES],
        transitions=_transitions(policy),
        initial=START,
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=False,
    )
    if machine.has_queue or machine.prepare_event or machine.finalize_event or machine.on_exception:
        raise ValueError("DecisionEvent skips the queue and the machine-wide callbacks; this machine has some")
    return machine


def mermaid(policy: FamilyPolicy) -> str:
    """The policy's machine as a Mermaid state diagram, read from the machine's own transitions."""
    machine = machine_for(policy)
    steps = {s.name: s for s in policy.steps}
    conclusion_text = {dest: text for dest, text, _ in CONCLUSIONS}
    lines = ["stateDiagram-v2", f"    [*] --> {START}"]
    for source, transitions in machine.events["advance"].transitions.items():
        for order, t in enumerate(transitions, 1):
            label = steps[t.dest].guard_text() if t.dest in steps else conclusion_text[t.dest]
            lines.append(f"    {source} --> {t.dest}: {order}. {label}")
    for state in TERMINAL_STATES:
        lines.append(f"    {state} --> [*]")
    return "\n".join(lines) + "\n"
