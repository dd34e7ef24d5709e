"""Eager experts calls replayed from CUDA graphs (``moe_fsm/modular/eager_graphs.py``) on a GPU.

Every replayed output is checked against the float64 reference and against the same kernel called
eagerly on the same inputs; outputs of earlier layers must survive later layers' replays (the static
buffers are shared by signature, the returned tensor is a copy).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from moe_fsm.decision import select  # noqa: E402
from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.modular import ops  # noqa: E402
from moe_fsm.modular.eager_graphs import EagerGraphs  # noqa: E402
from moe_fsm.runtime import build  # noqa: E402

from .moe_gpu_cases import QWEN3_30B, float_weights, hidden_states, reference, rel_err, routing  # noqa: E402

BF16_TOL = 1e-2
SAME_KERNEL_TOL = 1e-6  # the same kernels on the same inputs: equal up to atomics' summation order


def _kernel():
    shape = QWEN3_30B
    layer = MoELayer(num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden,
                     intermediate_size=shape.intermediate, dtype="bfloat16")
    kernel = build(select(layer, backend="triton"))
    assert kernel.capturable
    return kernel


def _inputs(tokens: int, seed: int):
    shape = QWEN3_30B
    g, ids = routing(tokens, shape.num_experts, shape.top_k, seed=seed)
    return hidden_states(tokens, shape.hidden, torch.bfloat16, seed=seed), g.to(torch.bfloat16), ids.to(torch.int64)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_replays_match_eager_and_float64(tokens):
    graphs = EagerGraphs()
    kernel = _kernel()
    handle = ops.register(kernel)
    w1, w2 = float_weights(QWEN3_30B)
    results = []
    for seed in range(5):
        x, g, ids = _inputs(tokens, seed)
        out = graphs.call(handle, kernel, x, w1, w2, g, ids, None)
        assert (out is None) == (seed == 0), "the first call runs eagerly, the second captures, later ones replay"
        if out is None:
            continue
        results.append((out, x, g, ids))
    assert graphs.num_graphs == 1
    for out, x, g, ids in results:  # outputs are copies: later replays did not overwrite them
        eager = kernel(x, w1, w2, g, ids, check_values=False)
        assert rel_err(out, eager) < SAME_KERNEL_TOL
        assert rel_err(out, reference(x, w1, w2, g, ids)) < BF16_TOL


def test_layers_of_one_signature_share_buffers_not_results():
    graphs = EagerGraphs()
    kernels = [_kernel(), _kernel()]
    handles = [ops.register(k) for k in kernels]
    weights = [float_weights(QWEN3_30B, seed=s) for s in (0, 1)]
    for step in range(4):
        outs = []
        for layer, (kernel, handle, (w1, w2)) in enumerate(zip(kernels, handles, weights)):
            x, g, ids = _inputs(3, seed=10 * step + layer)
            outs.append((graphs.call(handle, kernel, x, w1, w2, g, ids, None), x, g, ids, w1, w2))
        for out, x, g, ids, w1, w2 in outs:
            if out is not None:
                assert rel_err(out, reference(x, w1, w2, g, ids)) < BF16_TOL
    assert graphs.num_graphs == 2


def test_a_replaced_weight_is_captured_again():
    graphs = EagerGraphs()
    kernel = _kernel()
    handle = ops.register(kernel)
    w1, w2 = float_weights(QWEN3_30B)
    for seed in range(3):
        graphs.call(handle, kernel, *_with_weights(_inputs(2, seed), w1, w2), None)
    new_w1 = w1.clone() * 2
    x, g, ids = _inputs(2, 9)
    for _ in range(2):
        out = graphs.call(handle, kernel, x, new_w1, w2, g, ids, None)
    assert out is not None and graphs.num_graphs == 2
    assert rel_err(out, reference(x, new_w1, w2, g, ids)) < BF16_TOL


def test_token_counts_over_the_limit_run_eagerly():
    graphs = EagerGraphs(max_tokens=4)
    kernel = _kernel()
    handle = ops.register(kernel)
    w1, w2 = float_weights(QWEN3_30B)
    for seed in range(3):
        assert graphs.call(handle, kernel, *_with_weights(_inputs(5, seed), w1, w2), None) is None
    assert graphs.num_graphs == 0


def _with_weights(inputs, w1, w2):
    x, g, ids = inputs
    return x, w1, w2, g, ids


def test_a_kernel_that_reads_the_device_falls_back_with_a_warning():
    class ReadsTheDevice:
        name = "ReadsTheDevice"

        def __call__(self, hidden, w1, w2, topk_weights, topk_ids, *, expert_map=None, check_values=True):
            int(topk_ids.max())  # a host read: not permitted while the stream is capturing
            return hidden * 2

    graphs = EagerGraphs()
    kernel = ReadsTheDevice()
    x, g, ids = _inputs(2, 0)
    assert graphs.call(99, kernel, x, x, x, g, ids, None) is None
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        assert graphs.call(99, kernel, x, x, x, g, ids, None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graphs.call(99, kernel, x, x, x, g, ids, None) is None  # not tried again
    assert graphs.num_graphs == 0
    torch.cuda.synchronize()  # the device is still usable


def test_inside_a_callers_capture_the_kernels_go_into_the_callers_graph():
    graphs = EagerGraphs()
    kernel = _kernel()
    handle = ops.register(kernel)
    w1, w2 = float_weights(QWEN3_30B)
    x, g, ids = _inputs(4, 0)
    for _ in range(2):
        graphs.call(handle, kernel, x, w1, w2, g, ids, None)  # warm up, and one graph of our own
    outer = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x5, g5, ids5 = _inputs(5, 1)
        graphs.call(handle, kernel, x5, w1, w2, g5, ids5, None)  # eager warm-up of the 5-token signature
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(outer):
        out = graphs.call(handle, kernel, x5, w1, w2, g5, ids5, None)
        if out is None:
            out = kernel(x5, w1, w2, g5, ids5, check_values=False)
    assert graphs.num_graphs == 1
    new_x, new_g, new_ids = _inputs(5, 2)
    x5.copy_(new_x)
    g5.copy_(new_g)
    ids5.copy_(new_ids)
    outer.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(new_x, w1, w2, new_g, new_ids)) < BF16_TOL


def test_transformers_model_forward_replays_and_matches_without_graphs(tmp_path):
    transformers = pytest.importorskip("transformers")
    from moe_fsm.integrations.transformers import enable

    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, head_dim=64, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 96, (2, 9), device="cuda")
    enabled = enable(model, env={}, trace_dir=tmp_path / "a", eager_graphs=False)
    assert not any(p.eager_graphs for p in enabled.modules.values())
    with torch.no_grad():
        plain = model(ids).logits
    enabled = enable(model, env={}, trace_dir=tmp_path / "b", eager_graphs=True)
    assert all(p.eager_graphs for p in enabled.modules.values())
    before = ops.eager_graphs().num_graphs
    with torch.no_grad():
        outs = [model(ids).logits for _ in range(3)]
    assert ops.eager_graphs().num_graphs == before + 3  # one per layer, captured on the second forward
    for logits in outs:  # bf16: the top-k sum's atomics may round the last bit either way
        assert float((logits - plain).abs().max() / plain.abs().max()) < 1e-2


def _settle(graphs, handle, kernel, x, w1, w2, g, ids, calls=5):
    """Call with the same input tensors until a pinned graph serves them (eager, copying capture, sighting, pin),
    dropping each output at once as a forward does; the last call's output comes from the pinned graph."""
    for _ in range(calls):
        graphs.call(handle, kernel, x, w1, w2, g, ids, None)
    out = graphs.call(handle, kernel, x, w1, w2, g, ids, None)
    assert out.data_ptr() in {p.out.data_ptr() for p in graphs._pinned.values()}, "not served by a pinned graph"
    return out


def _refill(x, g, ids, seed):
    new_x, new_g, new_ids = _inputs(x.shape[0], seed)
    x.copy_(new_x)
    g.copy_(new_g)
    ids.copy_(new_ids)


PINNED = 256  # the default pinned limit (eager_graphs.py), passed explicitly so an environment override cannot turn these off


def test_pinned_graphs_read_the_inputs_where_they_are():
    graphs = EagerGraphs(pinned_max_tokens=PINNED)
    kernel = _kernel()
    handle = ops.register(kernel)
    w1, w2 = float_weights(QWEN3_30B)
    x, g, ids = _inputs(2, 0)
    _settle(graphs, handle, kernel, x, w1, w2, g, ids)
    assert graphs.num_pinned == 1 and graphs.num_graphs == 1
    for seed in (1, 2, 3):
        _refill(x, g, ids, seed)  # new values at the same addresses
        out = graphs.call(handle, kernel, x, w1, w2, g, ids, None)
        assert rel_err(out, kernel(x, w1, w2, g, ids, check_values=False)) < SAME_KERNEL_TOL
        assert rel_err(out, reference(x, w1, w2, g, ids)) < BF16_TOL
    assert graphs.num_pinned == 1


@pytest.mark.parametrize("hold", ["tensor", "view", "detached"])
def test_a_held_pinned_output_is_never_overwritten(hold):
    graphs = EagerGraphs(pinned_max_tokens=PINNED)
    kernel = _kernel()
    handle = ops.register(kernel)
    w1, w2 = float_weights(QWEN3_30B)
    x, g, ids = _inputs(3, 0)
    first = _settle(graphs, handle, kernel, x, w1, w2, g, ids)
    assert graphs.num_pinned == 1
    expected = reference(x, w1, w2, g, ids)
    held = {"tensor": first, "view": first.view(-1), "detached": first.detach()}[hold]
    snapshot = held.clone()
    del first
    _refill(x, g, ids, 7)
    second = graphs.call(handle, kernel, x, w1, w2, g, ids, None)
    torch.cuda.synchronize()
    assert torch.equal(held, snapshot), "a replay overwrote an output the caller still holds"
    assert rel_err(held.view(3, -1), expected) < BF16_TOL
    assert rel_err(second, reference(x, w1, w2, g, ids)) < BF16_TOL
    del held, second
    _refill(x, g, ids, 8)
    third = graphs.call(handle, kernel, x, w1, w2, g, ids, None)  # nothing held: the pinned graph serves again
    assert rel_err(third, reference(x, w1, w2, g, ids)) < BF16_TOL


def test_pinned_graphs_per_layer_are_bounded():
    graphs = EagerGraphs(pinned_max_tokens=PINNED, pinned_per_signature=2)
    kernel = _kernel()
    handle = ops.register(kernel)
    w1, w2 = float_weights(QWEN3_30B)
    sets = [_inputs(2, seed) for seed in range(4)]
    for _ in range(6):
        for x, g, ids in sets:
            out = graphs.call(handle, kernel, x, w1, w2, g, ids, None)
            if out is not None:
                assert rel_err(out, reference(x, w1, w2, g, ids)) < BF16_TOL
    assert graphs.num_pinned == 2 and graphs.num_graphs == 1


def test_a_graph_the_collector_frees_during_a_capture_does_not_invalidate_it():
    """An old graph kept alive only by a reference cycle that becomes garbage just before a capture, and a
    captured body that allocates enough Python objects for a collection: that collection would destroy the old
    graph, which CUDA refuses while a stream captures (the H100 suite once lost every capture of a worker that
    way). Captures hold the collector off, so the capture succeeds and replays."""
    import gc

    device = torch.device("cuda")
    gc.collect()  # what follows is young: a collection of the youngest generations frees it
    old = torch.cuda.CUDAGraph()
    scratch = torch.zeros(4, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        old.capture_begin()
        scratch.add_(1)
        old.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    cycle = [old]
    cycle.append(cycle)
    keep = [cycle]  # the only way to the cycle from outside it, dropped at the end of the uncaptured run
    del old, cycle
    x = torch.randn(64, device=device)
    out = torch.empty(64, device=device)
    calls = []

    def body():
        calls.append(1)
        if len(calls) == 2:  # the captured run: allocations enough for collections of the younger generations
            junk = [[i] for i in range(100 * gc.get_threshold()[0])]
            del junk
        out.copy_(x * 2)
        if len(calls) == 1:  # end of the uncaptured run: the cycle becomes garbage
            keep.clear()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture warns: fail instead
        graph = EagerGraphs().capture(device, body, "a test body", "the test fails")
    gc.collect()
    assert graph is not None
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out, x * 2)


def test_calls_on_two_streams_share_no_buffers():
    """An engine overlapping two batches on two streams: each stream's replays read their own inputs. Stream A
    is held back by a device sleep, so its copy-in and replay run after stream B has copied its inputs: with
    buffers shared by signature, A's graph would read B's tokens."""
    graphs = EagerGraphs(pinned_max_tokens=0)  # copying graphs: the static buffers are what two streams could share
    kernel = _kernel()
    handle = ops.register(kernel)
    w1, w2 = float_weights(QWEN3_30B)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:  # each lane sees the signature twice: its graph is captured
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for seed in range(2):
                graphs.call(handle, kernel, *_with_weights(_inputs(3, seed), w1, w2), None)
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert graphs.num_graphs == 2, "one graph per stream"

    inputs = [_inputs(3, 100), _inputs(3, 200)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs = []
    for lane, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            if lane == 0:
                torch.cuda._sleep(50_000_000)  # tens of ms on the device before stream A's copy-in
            outs.append(graphs.call(handle, kernel, *_with_weights(inputs[lane], w1, w2), None))
    torch.cuda.synchronize()
    for out, (x, g, ids) in zip(outs, inputs):
        assert out is not None, "replayed"
        assert rel_err(out, reference(x, w1, w2, g, ids)) < BF16_TOL


def test_calls_of_two_threads_on_two_streams_replay_their_own_inputs():
    """Two threads, each on a stream of its own, calling the same layer at once, replays included."""
    import threading

    graphs = EagerGraphs(pinned_max_tokens=0)
    kernel = _kernel()
    handle = ops.register(kernel)
    w1, w2 = float_weights(QWEN3_30B)
    errors: list = []
    barrier = threading.Barrier(2)

    def worker(lane: int) -> None:
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                for step in range(6):
                    x, g, ids = _inputs(3, 1000 * lane + step)
                    barrier.wait()
                    if lane == 0:
                        torch.cuda._sleep(20_000_000)
                    out = graphs.call(handle, kernel, x, w1, w2, g, ids, None)
                    if out is None:
                        out = kernel(x, w1, w2, g, ids, check_values=False)
                    stream.synchronize()
                    err = rel_err(out, reference(x, w1, w2, g, ids))
                    if not err < BF16_TOL:
                        errors.append((lane, step, err))
        except Exception as exc:  # surfaced below
            errors.append((lane, "raised", repr(exc)))

    threads = [threading.Thread(target=worker, args=(lane,)) for lane in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert graphs.num_graphs == 2
