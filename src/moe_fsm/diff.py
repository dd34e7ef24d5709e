"""The same layer under two policy profiles: what each decides, and where and why their paths part.

"What changes for my model when I upgrade vLLM?" Both decisions run on the
same inputs (the env snapshot is the same raw strings; each profile reads only
the variables it knows). A decision's events are cut into segments at its
transitions: the guards evaluated on the way into a state, then what happened
in it. The first segment that reads differently is where the paths part; its
events on each side say why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_fsm import profiles
from moe_fsm.decision import DecisionInputs, decide, speed_table_for
from moe_fsm.errors import SelectionError


@dataclass(frozen=True)
class Side:
    profile: str
    document: dict

    @property
    def outcome(self) -> dict:
        return self.document["outcome"]

    @property
    def decision_key(self) -> tuple:
        """What 'the same decision' means: the status, then the error type, or the runner (backend) and how tokens
        reach it (prepare/finalize). The kernel class is compared apart (``LayerDiff.same_kernel``): two engines name
        the same runner's class differently (vLLM's TrtLlmBf16ExpertsMonolithic, SGLang's FlashInferTrtllmFusedMoE),
        and a release can swap a backend's class without deciding differently."""
        o = self.outcome
        if o["status"] == "failed":
            return ("failed", o["error"]["type"])
        return (o["status"], o["backend"], o["prepare_finalize"]["name"])

    @property
    def kernel(self) -> str | None:
        return self.outcome.get("kernel")


@dataclass(frozen=True)
class Divergence:
    """Where two decisions part: the segment index, the state each side was in, and each side's events there."""

    segment: int
    state: tuple[str, str]  # the state each side had reached when they parted
    events: tuple[list[dict], list[dict]]


@dataclass(frozen=True)
class LayerDiff:
    before: Side
    after: Side
    divergence: Divergence | None  # None: the two paths do not part
    unread_env: tuple[tuple[str, ...], tuple[str, ...]]  # variables set that each profile does not read

    @property
    def same_decision(self) -> bool:
        return self.before.decision_key == self.after.decision_key

    @property
    def same_kernel(self) -> bool:
        """Both sides name the same kernel class (or neither names one)."""
        return self.before.kernel == self.after.kernel

    @property
    def identical(self) -> bool:
        """The same decision with the same kernel class."""
        return self.same_decision and self.same_kernel


def decide_under(inputs: DecisionInputs, profile: str, speed_table=None) -> dict:
    """The trace of ``inputs`` decided under ``profile`` (an error's trace when it fails); ``speed_table`` (a table,
    its path, None: this device's in the config directory, False: none) for a profile that reads one."""
    choice = profiles.ProfileChoice(profile, "moe-fsm diff")
    table = speed_table_for(choice, inputs.platform, inputs.speed_table or speed_table)
    try:
        return decide(replace(inputs, profile=choice, speed_table=table)).trace
    except SelectionError as err:
        return err.trace


def diff_layer(inputs: DecisionInputs, before: str, after: str, speed_table=None,
               after_inputs: DecisionInputs | None = None) -> LayerDiff:
    """``inputs`` decided under both profiles; ``after_inputs``: the second side's own inputs where the two engines
    read the same checkpoint layer differently (each profile's config rules: ``moe-fsm diff --config``)."""
    a = Side(before, decide_under(inputs, before, speed_table))
    b = Side(after, decide_under(after_inputs or inputs, after, speed_table))
    return LayerDiff(a, b, first_divergence(a.document, b.document), (_unread(inputs, before), _unread(inputs, after)))


def _unread(inputs: DecisionInputs, profile: str) -> tuple[str, ...]:
    reads = profiles.get(profile).env
    return tuple(name for name, _ in inputs.env.raw if name not in reads)


def segments(document: dict) -> list[tuple[str, list[dict]]]:
    """The events cut at each transition: (the state they happened in or led out of, events)."""
    out: list[tuple[str, list[dict]]] = []
    state, current = "start", []
    for event in document["events"]:
        current.append(event)
        if event["event"] == "transition":
            out.append((state, current))
            state, current = event["dest"], []
    if current:
        out.append((state, current))
    return out


def first_divergence(a: dict, b: dict) -> Divergence | None:
    """The first segment where the paths part: it leads to different states, or what happens in the
    state differs (a verdict, a scan order, a message). Guards that differ but lead to the same state
    (a step one profile has and skips) are not a parting."""
    sa, sb = segments(a), segments(b)
    for index in range(max(len(sa), len(sb))):
        state_a, events_a = sa[index] if index < len(sa) else ("(ended)", [])
        state_b, events_b = sb[index] if index < len(sb) else ("(ended)", [])
        if _dest(events_a) != _dest(events_b) or _acts(events_a) != _acts(events_b):
            return Divergence(index, (state_a, state_b), (events_a, events_b))
    if a["outcome"] != b["outcome"]:
        return Divergence(len(sa), ("(outcome)", "(outcome)"), ([], []))
    return None


def _dest(events: list[dict]) -> str | None:
    return events[-1]["dest"] if events and events[-1]["event"] == "transition" else None


def _acts(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] not in ("guard", "transition")]


def newest_release() -> str | None:
    """The release profile with the highest vLLM version, if any."""
    releases = [p for p in profiles.profiles().values() if p.vllm_version is not None]
    return max(releases, key=lambda p: p.vllm_version).name if releases else None
