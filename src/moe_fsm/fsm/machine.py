"""The one state machine every decision runs through, built once per process.

States are vLLM's oracle steps made explicit. ``advance`` moves to the next
step whose guard holds (the guard is evaluated, and recorded, by the decision
model); ``conclude`` ends in selected, fallback_none or failed. Which steps a
family has, and in what order, is its policy's data: the edges here are the
union over the three policies, so one definition serves all of them.
"""

from __future__ import annotations

from functools import lru_cache

from transitions import Machine

from moe_fsm.fsm.policy import (
    AUTO_SCAN, ENV_OVERRIDE, EXPLICIT_USER_CHOICE, FAILED, FALLBACK_NONE, FLASHINFER_PREFERENCE,
    FORCED_MARLIN, LORA_SHORTCUT, POLICIES, SELECTED, START, STEP_STATES, TERMINAL_STATES,
)

GUARD_TEXT = {
    LORA_SHORTCUT: "LoRA on and the family has a LoRA backend",
    EXPLICIT_USER_CHOICE: "backend requested for the family is not auto",
    FLASHINFER_PREFERENCE: "the family's VLLM_USE_FLASHINFER_MOE_* is set (FP16: reads 1)",
    ENV_OVERRIDE: "a DeepGEMM / AITER variable is set",
    FORCED_MARLIN: "VLLM_TEST_FORCE_FP8_MARLIN reads true",
    AUTO_SCAN: "no earlier step decided",
}
CONCLUSIONS = (
    (SELECTED, "has_selection", "a backend's verdict is supported"),
    (FALLBACK_NONE, "falls_back_to_platform", "FP8 scan exhausted off CUDA/ROCm"),
    (FAILED, "has_error", "an error was raised"),
)


def _advance_edges() -> list[tuple[str, str]]:
    """Every (source, dest) some policy can take: any step may be skipped when its guard fails."""
    edges = []
    for policy in POLICIES.values():
        states = [START] + [step.state for step in policy.steps]
        for i, source in enumerate(states[:-1]):
            for dest in states[i + 1:]:
                if (source, dest) not in edges:
                    edges.append((source, dest))
    return edges


def _conclude_edges() -> list[tuple[str, str, str]]:
    edges = []
    for state in STEP_STATES:
        for dest, condition, _ in CONCLUSIONS:
            if dest == FALLBACK_NONE and state != AUTO_SCAN:
                continue
            edges.append((state, dest, condition))
    return edges


@lru_cache(maxsize=1)
def selection_machine() -> Machine:
    """The shared machine; decision models are driven through it without being added to it."""
    transitions = [
        {"trigger": "advance", "source": s, "dest": d, "conditions": "next_step_is", "after": "on_entered"}
        for s, d in _advance_edges()
    ] + [
        {"trigger": "conclude", "source": s, "dest": d, "conditions": c, "after": "on_entered"}
        for s, d, c in _conclude_edges()
    ]
    return Machine(
        model=None,
        states=[START, *STEP_STATES, *TERMINAL_STATES],
        transitions=transitions,
        initial=START,
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=False,
    )


def mermaid() -> str:
    """The machine as a Mermaid state diagram, read from the machine's own transitions."""
    machine = selection_machine()
    lines = ["stateDiagram-v2", f"    [*] --> {START}"]
    for event_name in ("advance", "conclude"):
        event = machine.events[event_name]
        for source, transitions in event.transitions.items():
            for t in transitions:
                if event_name == "advance":
                    label = f"advance [{GUARD_TEXT[t.dest]}]"
                else:
                    label = next(text for dest, _, text in CONCLUSIONS if dest == t.dest)
                    label = f"conclude [{label}]"
                lines.append(f"    {source} --> {t.dest}: {label}")
    for state in TERMINAL_STATES:
        lines.append(f"    {state} --> [*]")
    return "\n".join(lines) + "\n"
