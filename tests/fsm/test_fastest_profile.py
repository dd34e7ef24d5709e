"""fastest-vllm-0.33: vLLM 0.33's rules, the auto scan ordered by a measured speed table (fsm/measured_steps.py).

What is checked: with a table the measured scan chooses by the figures and records them; never slower than the
base profile's choice at a measured point (on random tables too); ties go to the base's choice, then to the scan
order; without a table, for another device or an unmeasured shape it decides exactly as vllm-0.33 on every
golden scenario of that profile; bad tables are refused naming the field; the new trace parts validate.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from moe_fsm import golden, profiles
from moe_fsm.decision import DecisionInputs, decide, inputs_from_spec, make_inputs, replay, select
from moe_fsm.errors import InputError, SelectionError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.speed import SpeedTable, read_speed_table, shape_key, table_file_name, table_for_device
from moe_fsm.trace import document as trace_doc
from moe_fsm.trace import schema

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "speed" / "nvidia_h100.json"
FASTEST = "fastest-vllm-0.33"
QWEN3 = MoELayer(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)
QWEN3_KEY = "E=128,N=768,K=2048,topk=8,dtype=bfloat16,quant=unquantized"


def _table(figures: dict, device: str = "NVIDIA H100", key: str = QWEN3_KEY) -> SpeedTable:
    return SpeedTable.from_json({
        "format": "moe-fsm speed table 1", "device": device,
        "measured": {"date": "2026-11-27", "moe_fsm_version": "test", "command": "test", "method": "test"},
        "shapes": {key: {"tokens": {str(t): row for t, row in figures.items()}}},
    }, source="test-table")


def _select(table, layer=QWEN3, platform="sm90", backend=None, policy=FASTEST):
    return select(layer, platform=preset(platform), backend=backend, env={}, policy=policy,
                  speed_table=table if table is not None else False)


def _event(trace: dict, kind: str) -> dict | None:
    return next((e for e in trace["events"] if e["event"] == kind), None)


def _speed_guard(trace: dict) -> dict:
    return next(e for e in trace["events"] if e["event"] == "guard" and e["guard"] == "speed_table")


def test_the_fixture_table_orders_qwen3s_shape_and_records_the_figures():
    decision = _select(read_speed_table(FIXTURE))
    assert (decision.backend, decision.via, decision.kernel) == ("TORCH_GROUPED_MM", "measured_scan", "GroupedMMExperts")
    measured = _event(decision.trace, "measured")
    assert measured["table"] == str(FIXTURE) and measured["device"] == "NVIDIA H100" and measured["date"] == "2026-11-27"
    assert (measured["base"], measured["chosen"], measured["tokens"]) == ("TRITON", "TORCH_GROUPED_MM", [1, 128, 2048])
    rows = {row["backend"]: row for row in measured["figures"]}
    assert rows["TRITON"]["us"] == {"1": 20.0, "128": 60.0, "2048": 400.0}
    assert rows["TORCH_GROUPED_MM"]["eligible"] and rows["TORCH_GROUPED_MM"]["geomean_us"] < rows["TRITON"]["geomean_us"]
    # faster on the mean, but slower than vLLM's choice at 1 token: never chosen
    assert not rows["FLASHINFER_CUTLASS"]["eligible"] and "slower than TRITON at 1" in rows["FLASHINFER_CUTLASS"]["reason"]
    assert decision.trace["inputs"]["speed_table"]["sha256"] == read_speed_table(FIXTURE).sha256()
    schema.validate(decision.trace)


def test_without_a_table_the_guard_says_so_and_the_base_scan_decides():
    decision = _select(None)
    guard = _speed_guard(decision.trace)
    assert guard["result"] is False and "no speed table" in guard["inputs"]["reason"]
    assert decision.trace["path"] == ["start", "auto_scan", "selected"] and decision.backend == "TRITON"
    assert "speed_table" not in decision.trace["inputs"]


def test_a_table_for_another_device_is_ignored_with_the_reason():
    table = _table({1: {"TRITON": 10.0, "TORCH_GROUPED_MM": 1.0}}, device="NVIDIA H200")
    decision = _select(table)
    guard = _speed_guard(decision.trace)
    assert guard["result"] is False and "measured on 'NVIDIA H200'" in guard["inputs"]["reason"]
    assert (decision.backend, decision.via) == ("TRITON", "auto_scan")


def test_an_unmeasured_shape_is_decided_as_the_base():
    table = _table({1: {"TRITON": 10.0, "TORCH_GROUPED_MM": 1.0}}, key="E=8,N=1,K=1,topk=1,dtype=bfloat16,quant=unquantized")
    decision = _select(table)
    assert "no entry for this shape" in _speed_guard(decision.trace)["inputs"]["reason"]
    assert decision.via == "auto_scan"


def test_the_base_choice_without_a_figure_is_kept_and_said():
    decision = _select(_table({1: {"TORCH_GROUPED_MM": 1.0}}))
    measured = _event(decision.trace, "measured")
    assert decision.backend == "TRITON" and "has no figure" in measured["because"]
    assert measured["tokens"] == []


def test_ties_go_to_the_base_choice_then_to_the_scan_order():
    assert _select(_table({1: {"TRITON": 5.0, "TORCH_GROUPED_MM": 5.0}})).backend == "TRITON"
    # two candidates tie below the base: the one the base profile scans first (FlashInfer CUTLASS) wins,
    # whichever order the file lists them in
    for row in ({"FLASHINFER_CUTLASS": 3.0, "TORCH_GROUPED_MM": 3.0, "TRITON": 5.0},
                {"TORCH_GROUPED_MM": 3.0, "TRITON": 5.0, "FLASHINFER_CUTLASS": 3.0}):
        assert _select(_table({1: row, 64: {k: v * 2 for k, v in row.items()}})).backend == "FLASHINFER_CUTLASS"


def test_never_slower_than_the_base_choice_at_any_measured_point():
    rng = random.Random(44)
    names = ("TRITON", "TORCH_GROUPED_MM", "FLASHINFER_CUTLASS", "FLASHINFER_TRTLLM")
    chose_other = 0
    for _ in range(200):
        points = rng.sample([1, 8, 64, 512, 4096], rng.randint(1, 4))
        figures = {t: {n: round(rng.uniform(5, 50), 1) for n in names if rng.random() < 0.9} for t in points}
        figures = {t: row for t, row in figures.items() if row}
        if not figures:
            continue
        decision = _select(_table(figures))
        base = "TRITON"  # vLLM 0.33's choice for this layer on Hopper
        for row in figures.values():
            if base in row:
                assert row[decision.backend] <= row[base]
        chose_other += decision.backend != base
    assert chose_other > 20  # the rule did choose by the figures, not always the base


def test_without_a_table_every_vllm_033_golden_scenario_decides_the_same():
    scenarios = golden.load_scenarios(ROOT / "traces", "vllm-0.33")
    assert len(scenarios) > 100
    for scenario in scenarios:
        base_inputs = scenario.inputs()
        fastest_inputs = replace(base_inputs, profile=profiles.ProfileChoice(FASTEST, "test"))
        outcomes = []
        for inputs, name in ((base_inputs, "vllm-0.33"), (fastest_inputs, FASTEST)):
            try:
                outcomes.append(decide(inputs, registry=golden.registry(name), trace=False).trace["outcome"])
            except SelectionError as err:
                outcomes.append(err.trace["outcome"])
        assert outcomes[0] == outcomes[1], scenario.name


def test_other_profiles_never_carry_a_table():
    inputs = make_inputs(QWEN3, platform=preset("sm90"), env={}, policy="vllm-0.33", speed_table=FIXTURE)
    assert inputs.speed_table is None and "speed_table" not in inputs.to_json()


def test_replay_is_byte_identical_and_an_edited_recorded_table_is_refused():
    decision = _select(read_speed_table(FIXTURE))
    assert replay(decision.trace) == trace_doc.canonical(decision.trace)
    edited = copy.deepcopy(decision.trace)
    edited["inputs"]["speed_table"]["shapes"][QWEN3_KEY]["tokens"]["1"]["TRITON"] = 1.0
    with pytest.raises(InputError, match="'sha256' .* does not match its content"):
        DecisionInputs.from_json(edited["inputs"])


def test_the_table_in_the_config_directory_is_found_by_device_name(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_FSM_SPEED_TABLE_DIR", str(tmp_path))
    assert table_for_device("NVIDIA H100") is None
    assert table_file_name("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3.json"
    (tmp_path / "nvidia_h100.json").write_text(FIXTURE.read_text())
    inputs = make_inputs(QWEN3, platform=preset("sm90"), env={}, policy=FASTEST)
    assert inputs.speed_table is not None and inputs.speed_table.source == str(tmp_path / "nvidia_h100.json")
    assert decide(inputs).backend == "TORCH_GROUPED_MM"
    # false: none, without looking
    assert inputs_from_spec({"layer": {}, "platform": "sm90", "policy": FASTEST, "speed_table": False}).speed_table is None


def test_the_shape_key_is_the_shard_one_gpu_runs():
    assert shape_key(QWEN3, ParallelConfig()) == QWEN3_KEY
    assert shape_key(QWEN3, ParallelConfig(tp_size=2)).startswith("E=128,N=384,")
    assert shape_key(QWEN3, ParallelConfig(tp_size=2, ep_size=2)).startswith("E=64,N=768,")


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def _set(path, value):
    def edit(data):
        *parents, last = path
        target = data
        for key in parents:
            target = target[key]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value
        return data
    return edit


_DELETE = object()
BAD = [
    (_set(["format"], "v2"), "'format' must be 'moe-fsm speed table 1'"),
    (_set(["device"], ""), "'device' must name the device"),
    (_set(["measured", "date"], "27/11/2026"), "'measured.date' must be YYYY-MM-DD"),
    (_set(["measured", "command"], _DELETE), "'measured.command' must be a non-empty string"),
    (_set(["shapes"], {}), "'shapes' must be a non-empty object"),
    (_set(["shapes", "qwen3"], {"tokens": {"1": {"TRITON": 1.0}}}), "shape key 'qwen3' must look like"),
    (_set(["shapes", QWEN3_KEY, "tokens", "0"], {"TRITON": 1.0}), "'0' is not a positive token count"),
    (_set(["shapes", QWEN3_KEY, "tokens", "1", "TRITON"], -3), "tokens['1'].TRITON must be a positive number"),
    (_set(["shapes", QWEN3_KEY, "tokens", "1", "TRITON"], "fast"), "tokens['1'].TRITON must be a positive number"),
    (_set(["shapes", QWEN3_KEY, "tokens", "1", "triton"], 1.0), "'triton' is not a backend name"),
    (_set(["extra"], 1), "unknown field(s) ['extra']"),
]


@pytest.mark.parametrize("edit, message", BAD, ids=[m for _, m in BAD])
def test_a_bad_table_is_refused_naming_the_field(tmp_path, edit, message):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(edit(_fixture())))
    with pytest.raises(InputError) as err:
        read_speed_table(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_an_unreadable_or_non_json_table_is_one_line(tmp_path):
    with pytest.raises(InputError, match="cannot be read"):
        read_speed_table(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="not JSON"):
        read_speed_table(tmp_path / "bad.json")


def test_the_schema_refuses_malformed_measured_events_and_tables():
    trace = _select(read_speed_table(FIXTURE)).trace
    schema.validate(trace)
    for mutate in (
        lambda t: _event(t, "measured")["figures"][0]["us"].update({"1": 0}),
        lambda t: _event(t, "measured").pop("chosen"),
        lambda t: _event(t, "measured").update(sha256="abc"),
        lambda t: t["inputs"]["speed_table"].pop("sha256"),
        lambda t: t["inputs"]["speed_table"]["shapes"][QWEN3_KEY]["tokens"].update({"x": {}}),
        lambda t: _speed_guard(t)["inputs"].pop("reason"),
    ):
        bad = copy.deepcopy(trace)
        mutate(bad)
        with pytest.raises(schema.TraceSchemaError):
            schema.validate(bad)


def test_the_example_table_measured_on_an_h200_reads_back_and_decides():
    table = read_speed_table(ROOT / "docs" / "perf" / "speed_table_h200.json")
    h200 = replace(preset("sm90-bare"), device_name="NVIDIA H200")
    decision = select(QWEN3, platform=h200, env={}, policy=FASTEST, speed_table=table)
    assert (decision.via, decision.backend) == ("measured_scan", "TRITON")
    assert _event(decision.trace, "measured")["tokens"] == [1, 8, 64, 512, 2048]
