"""The published trace schema: one copy in docs/, one shipped with the package, both strict."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest

from moe_fsm.decision import decide, make_inputs
from moe_fsm.errors import SelectionError
from moe_fsm.inputs.layer import Activation, MoELayer
from moe_fsm.inputs.parallel import AllToAllKind, ParallelConfig
from moe_fsm.inputs.platform import Library, Vendor, preset
from moe_fsm.inputs.quant import Granularity, QuantScheme
from moe_fsm import profiles
from moe_fsm.fsm.policy import TERMINAL_STATES
from moe_fsm.trace import schema

ROOT = Path(__file__).resolve().parents[1]
DOCS_SCHEMA = ROOT / "docs" / "trace-schema.json"

jsonschema = pytest.importorskip("jsonschema")


def test_docs_and_package_copies_are_identical():
    shipped = Path(schema.__file__).resolve().parents[1] / "data" / "trace-schema.json"
    assert DOCS_SCHEMA.read_bytes() == shipped.read_bytes(), (
        "docs/trace-schema.json and src/moe_fsm/data/trace-schema.json differ: copy docs/ over the package copy"
    )
    assert schema.load_schema() == json.loads(DOCS_SCHEMA.read_text())


def test_schema_is_a_valid_draft_2020_12_schema():
    document = json.loads(DOCS_SCHEMA.read_text())
    assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(document)


def test_schema_enums_follow_the_code():
    defs = schema.load_schema()["$defs"]
    assert set(defs["terminal_state"]["enum"]) == set(TERMINAL_STATES)
    state = re.compile(defs["state"]["pattern"])
    env_var = re.compile(defs["env_var"]["pattern"])
    for name in profiles.names():
        profile = profiles.get(name)
        assert re.fullmatch(defs["profile"]["properties"]["name"]["pattern"], name)
        for family, policy in profile.policies.items():
            assert re.fullmatch(defs["family"]["pattern"], family.value)
            for step in policy.steps:
                assert state.fullmatch(step.name) and step.name not in ("start", *TERMINAL_STATES), step.name
        assert all(env_var.fullmatch(n) for n in profile.env)
    assert set(defs["platform"]["properties"]["vendor"]["enum"]) == {v.value for v in Vendor}
    assert set(defs["platform"]["properties"]["libraries"]["items"]["enum"]) == {lib.value for lib in Library}
    assert set(defs["layer"]["properties"]["activation"]["enum"]) == {a.value for a in Activation}
    assert set(defs["parallel"]["properties"]["all2all"]["enum"]) == {k.value for k in AllToAllKind}
    assert set(defs["quant_key"]["properties"]["granularity"]["enum"]) == {g.value for g in Granularity}
    from moe_fsm.prepare_finalize.choice import PrepareFinalizeKind

    assert set(defs["prepare_finalize"]["properties"]["kind"]["enum"]) == {k.value for k in PrepareFinalizeKind}


def _selected() -> dict:
    layer = MoELayer(quant=QuantScheme.fp8())
    return decide(make_inputs(layer, ParallelConfig(tp_size=2, ep_size=2), "auto",
                              {"VLLM_USE_FLASHINFER_MOE_FP8": "1"},
                              preset("sm90"))).trace


def _failed() -> dict:
    with pytest.raises(SelectionError) as info:
        decide(make_inputs(MoELayer(quant=QuantScheme.fp8("tensor", "tensor", True)), None, "flashinfer_b12x", {},
                           preset("sm121")))
    return info.value.trace


def test_real_traces_validate():
    for document in (_selected(), _failed()):
        assert schema.errors(document) == []
        schema.validate(document)


MUTATIONS = {
    "unknown top-level field": lambda d: d.update(extra=1),
    "wrong schema id": lambda d: d.update(schema="other"),
    "wrong schema version": lambda d: d.update(schema_version=2),
    "missing outcome": lambda d: d.pop("outcome"),
    "family disagrees with the layer": lambda d: d.update(family="nvfp4"),
    "malformed state in path": lambda d: d["path"].insert(1, "Warp Drive!"),
    "path without terminal": lambda d: d["path"].pop(),
    "two terminals": lambda d: d["path"].append("failed"),
    "start twice": lambda d: d["path"].insert(1, "start"),
    "unknown event": lambda d: d["events"].append({"event": "teleport"}),
    "guard without result": lambda d: d["events"][0].pop("result"),
    "guard with stray field": lambda d: d["events"][0].update(why="because"),
    "malformed env var in a reading": lambda d: next(e for e in d["events"] if e.get("guard") == "flashinfer_env")["inputs"]["env"][0].update(name="vllm nope"),
    "candidate supported without kernel": lambda d: next(e for e in d["events"] if e["event"] == "candidate" and e["supported"]).update(kernel=None),
    "candidate rejected without reason": lambda d: next(e for e in d["events"] if e["event"] == "candidate" and not e["supported"]).update(reason=None),
    "transition from start to a terminal state": lambda d: next(e for e in d["events"] if e["event"] == "transition").update(dest="selected"),
    "guard of an unknown kind": lambda d: d["events"][0].update(guard="vibes"),
    "profile without reason": lambda d: d["inputs"]["profile"].pop("reason"),
    "layer without dtype": lambda d: d["inputs"]["layer"].pop("dtype"),
    "negative experts": lambda d: d["inputs"]["layer"].update(num_experts=-1),
    "malformed env var in inputs": lambda d: d["inputs"]["env"].update({"vllm typo": "1"}),
    "env value not a string": lambda d: d["inputs"]["env"].update(VLLM_USE_FLASHINFER_MOE_FP8=1),
    "cuda without capability": lambda d: d["inputs"]["platform"].update(capability=None),
    "unknown library": lambda d: d["inputs"]["platform"]["libraries"].append("cudnn"),
    "request mapping with unknown family": lambda d: d["inputs"].update(request={"int9": "triton"}),
    "selected outcome with error": lambda d: d["outcome"].update(error={"type": "NoBackendError", "builtin": "NotImplementedError", "message": "x"}),
    "selected outcome without prepare/finalize": lambda d: d["outcome"].pop("prepare_finalize"),
    "status disagrees with path": lambda d: d["outcome"].update(status="fallback_none", backend="NONE"),
    "volatile with stray field": lambda d: d["volatile"].update(gpu="H100"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_malformed_selected_trace_is_rejected(name):
    document = copy.deepcopy(_selected())
    MUTATIONS[name](document)
    assert schema.errors(document), f"the schema accepted a trace with: {name}"
    with pytest.raises(schema.TraceSchemaError):
        schema.validate(document)


FAILED_MUTATIONS = {
    "error type not ours": lambda d: d["outcome"]["error"].update(type="KeyError"),
    "builtin disagrees with type": lambda d: d["outcome"]["error"].update(builtin="NotImplementedError"),
    "failed outcome with backend": lambda d: d["outcome"].update(backend="TRITON"),
    "empty message": lambda d: d["outcome"]["error"].update(message=""),
}


@pytest.mark.parametrize("name", sorted(FAILED_MUTATIONS))
def test_malformed_failed_trace_is_rejected(name):
    document = copy.deepcopy(_failed())
    FAILED_MUTATIONS[name](document)
    assert schema.errors(document), f"the schema accepted a trace with: {name}"


def test_canonical_trace_without_volatile_validates():
    document = _selected()
    document.pop("volatile")
    assert schema.errors(document) == []


def test_without_jsonschema_the_own_validator_still_refuses_malformed_traces(monkeypatch):
    """Issue 12 item 12: jsonschema is a test extra; the package validates with what it depends on."""
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    schema._validator.cache_clear()
    try:
        assert schema.jsonschema_installed() is False
        assert schema.errors(_selected()) == []
        broken = _selected()
        broken["outcome"]["status"] = "chosen"
        with pytest.raises(schema.TraceSchemaError, match="outcome"):
            schema.validate(broken)
    finally:
        schema._validator.cache_clear()
