"""The eager ``max_tokens_per_rank`` all-to-all call replayed from CUDA graphs its prepare/finalize captured itself.

Why: on a GPU host each Triton launch of a call costs 27-57 µs of host time and each collective 50-85 µs
(``docs/perf/distributed.md``), so the eager call of :class:`AllToAllPrepareFinalize` built with
``max_tokens_per_rank`` (four kernels, a concatenation, two collectives, a dozen views: ~350 µs of host time) is
host-bound, while the same call replayed from a graph by its caller meets the speed targets. Such a call's work
depends on no token count (every rank sends every rank a block of ``max_tokens_per_rank`` rows), so the P/F
captures it once and every later eager call copies its inputs in and replays:

* prepare: the tokens, top-k weights and top-k ids are copied into static buffers of ``max_tokens_per_rank``
  rows (three copies), and one graph replays route, packing, send rows, the all-to-all and the receiving side.
  A call of M tokens fills the first M rows; the ids of the rows past M are -1, which route nowhere (the route
  kernel counts no pair whose id is outside [0, E), so those tokens fill no send row and come back from no
  rank), so one graph serves every token count up to the capacity. The ids past M are set to -1 only when M
  shrinks (a copy or a fill of those rows otherwise); the stale tokens and weights there are read by no kernel
  that writes a sent byte.
* finalize: the experts' output is copied into a static buffer, one graph replays the local finalize, the
  all-to-all back and the combine into a static output of ``max_tokens_per_rank`` rows, and its first M rows are
  copied into the caller's output.

What a graph is captured for (the key): the lane (device, stream, thread: as ``modular/eager_graphs.py``), the
dtypes and widths of the tokens, weights and ids, ``apply_router_weight_on_input``, and how the tokens leave
quantized; a finalize graph also by the experts' output's dtype and shape, the output's dtype and the reduction.
The capacity, world and placement are the P/F's own. Only calls whose source-side work is per token are replayed:
no quantizer, or the dynamic per-token / 1x128-group FP8 quantization the send-row kernel applies itself. Any
other quantizer is a callable the graph would freeze (and a per-tensor one would see the padding rows): those
calls run eagerly.

Plain eager calls instead (bit-identical results either way): while the caller is itself capturing (its graph
takes the launches), off CUDA or without Triton, under Triton's interpreter, over a backend other than NCCL, with
``MOE_FSM_DISPATCH_GRAPHS=0``, after a capture failed for that key (on any rank), while tokens a replay handed
out are still held (below), and once :func:`release_graphs` freed the graphs (``moe_fsm.distributed.destroy`` does,
before the process group goes: NCCL never destroys a communicator while a graph holds one of its collectives).

Outputs: a replayed prepare hands out aliases of the graph's own tensors, which the next replay of any graph on
the lane overwrites. So a prepare replays only when nothing the last replay on its lane handed out is still held
(the use count of those tensors' storages, as eager_graphs' pinned graphs check): a caller that keeps prepared
tokens (two micro-batches in flight, or tokens kept past finalize) gets eager calls meanwhile, whose tensors are
fresh. Finalize writes only the caller's output, as the plain call does.

Memory: the graphs of a lane (every P/F of a layer stack on one stream) share one memory pool and the static
buffers of one shape; only each graph's prepared tokens (the received rows: W x capacity rows of the wire) stay
held per graph. Sharing the scratch is safe because at most one replayed prepare is outstanding on a lane (above),
so no graph's scratch can hold tokens someone still reads.

Ranks in step: a capture warms up once uncaptured (both collectives run) and then captures, so every rank must
capture on the same call: the capture is decided by the key and the switches alone (never by held tokens), which
are the same on every rank of an expert-parallel group that calls in step, as its collectives require anyway. After
each capture the ranks agree by one all-reduce whether every rank's capture worked, so a failure anywhere makes
every rank run that key eagerly. Whether a call then replays or runs the plain call depends on held tokens too;
where only some ranks hold theirs, they issue the same collectives in the same order, some from a graph and some
from Python (not tested on GPUs: the engines here hold tokens alike on every rank).
"""

from __future__ import annotations

import gc
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from moe_fsm.distributed.group import before_destroy
from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.triton_moe._runtime import HAS_TRITON, interpreter_enabled
from moe_fsm.modular.interfaces import InputQuantizer, PreparedTokens, PrepareFinalize, WeightAndReduce

ENV = "MOE_FSM_DISPATCH_GRAPHS"


def enabled_by_env() -> bool:
    """``MOE_FSM_DISPATCH_GRAPHS`` unset or anything but 0/false/no/off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _lane(device: torch.device) -> tuple[int, int, int]:
    """(device, the caller's current stream on it, the calling thread): what graphs, pool and buffers are kept per."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, torch._C._cuda_getCurrentRawStream(index), threading.get_ident()


@dataclass
class _StaticInputs:
    """The static inputs a prepare graph reads (``capacity`` rows each), and how many leading rows of ``topk_ids``
    the last call wrote (the rows past them hold -1)."""

    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    written: int = 0

    def copy_in(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> int:
        """The call's tokens into the first rows; ids past them -1 (written only where the count shrank)."""
        num_tokens = hidden.shape[0]
        self.hidden[:num_tokens].copy_(hidden)
        self.topk_weights[:num_tokens].copy_(topk_weights)
        self.topk_ids[:num_tokens].copy_(topk_ids)
        if num_tokens < self.written:
            self.topk_ids[num_tokens : self.written].fill_(-1)
        self.written = num_tokens
        return num_tokens


@dataclass
class _Lane:
    """What the graphs of one lane share: a memory pool (kept alive by ``anchor``, see :func:`_pool_anchor`), a
    capture stream, static buffers by shape, and the prepared tokens of the last replayed prepare with their
    storages' use counts while only the graph held them (``last``; kept here too, so that those storages outlive a
    P/F dropped meanwhile: their addresses are what ``outstanding`` reads, and while an alias lives its memory must
    stay out of reach of every graph's scratch)."""

    device: torch.device
    pool: tuple
    stream: torch.cuda.Stream
    anchor: Optional[torch.cuda.CUDAGraph] = None
    statics: dict = field(default_factory=dict)
    last: Optional[tuple[PreparedTokens, dict]] = None

    def static(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (name, shape, dtype)
        buffer = self.statics.get(key)
        if buffer is None:
            buffer = self.statics[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buffer

    def inputs(self, capacity: int, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> _StaticInputs:
        """The static inputs of ``capacity`` rows for calls shaped like these, shared by every graph of the lane."""
        key = ("inputs", capacity, hidden.dtype, hidden.shape[1], topk_weights.dtype, topk_weights.shape[1],
               topk_ids.dtype, topk_ids.shape[1])
        held = self.statics.get(key)
        if held is None:
            held = self.statics[key] = _StaticInputs(
                torch.zeros((capacity, hidden.shape[1]), dtype=hidden.dtype, device=self.device),
                torch.zeros((capacity, topk_weights.shape[1]), dtype=topk_weights.dtype, device=self.device),
                torch.full((capacity, topk_ids.shape[1]), -1, dtype=topk_ids.dtype, device=self.device),
            )
        return held

    def outstanding(self) -> bool:
        """Whether anything the last replayed prepare handed out (or a view made from it) is still held by someone."""
        return self.last is not None and any(
            torch._C._storage_Use_Count(storage) > alone for storage, alone in self.last[1].items())


_LANES: dict[tuple[int, int, int], _Lane] = {}
_LIVE: "weakref.WeakSet[DispatchGraphs]" = weakref.WeakSet()  # every P/F's graphs, for release_graphs


def release_graphs() -> None:
    """Free every graph the P/Fs of this process captured, the lanes' pools with them; later calls run plainly.

    :func:`moe_fsm.distributed.destroy` calls this before it destroys the process group: NCCL destroys a
    communicator only once every graph holding one of its collectives is gone, and a P/F (with its graphs) usually
    outlives the group in the caller's frame, which hung ``run --nproc 2`` at exit. A caller that destroys the group
    itself (``torch.distributed.destroy_process_group``) calls this first.
    """
    if _LANES:  # a lane exists once a graph was captured on CUDA
        torch.cuda.synchronize()  # no replay in flight while its graph goes
    for graphs in list(_LIVE):
        graphs.release()
    _LANES.clear()


before_destroy(release_graphs)


def _lane_state(lane: tuple[int, int, int]) -> _Lane:
    state = _LANES.get(lane)
    if state is None:
        device = torch.device("cuda", lane[0])
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        state = _LANES[lane] = _Lane(device, pool, stream, _pool_anchor(device, pool, stream))
    return state


def _pool_anchor(device: torch.device, pool: tuple, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """A graph of one small fill captured into ``pool``, which the lane keeps for as long as the process runs.

    torch's caching allocator lets a capture share a pool only while a live graph uses it: once every graph of a
    pool is destroyed, a capture into it fails an internal assertion (``use_count > 0``) for as long as any of its
    blocks is still allocated, and the lane keeps the last replay's tokens there. The P/Fs' graphs come and go with
    them (a model or a test dropping its layers), so the pool is held by a graph of the lane's own.
    """
    stream.wait_stream(torch.cuda.current_stream(device))
    anchor = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        torch.zeros(1, device=device)  # the fill kernel loaded before the capture, which may not load it
        anchor.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            torch.zeros(1, device=device)
        finally:
            anchor.capture_end()
    return anchor


@dataclass
class _Captured:
    """One key's prepare graph, its static inputs and prepared tokens, and its finalize graphs."""

    lane: _Lane
    graph: torch.cuda.CUDAGraph
    inputs: _StaticInputs
    prepared: PreparedTokens  # the graph's output (the plain prepare's, on the static inputs)
    expert_map: torch.Tensor  # the int32 map the graph reads, kept alive with it
    finalize: dict = field(default_factory=dict)  # key -> (graph, static experts' output, static output) or None


@dataclass(frozen=True)
class ReplayedDispatch:
    """The state a replayed prepare hands out: its graph and the call's token count."""

    captured: _Captured
    num_tokens: int

    @property
    def row_bytes(self) -> int:
        """The width of one dispatched row on the wire, as ``DispatchState.row_bytes``."""
        return self.captured.prepared.state.row_bytes


def prepare_key(lane: tuple, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                apply_router_weight_on_input: bool, fused_fp8_rows: Optional[str]) -> tuple:
    """What a prepare graph is captured for: all that changes its launches, and not the token count (padded)."""
    return (lane, hidden.dtype, hidden.shape[1], topk_weights.dtype, topk_weights.shape[1], topk_ids.dtype,
            topk_ids.shape[1], apply_router_weight_on_input, fused_fp8_rows)


def finalize_key(expert_output: torch.Tensor, output: torch.Tensor, reduce: WeightAndReduce,
                 apply_router_weight_on_input: bool) -> tuple:
    """What a finalize graph (of one prepare graph) is captured for; the output's rows are the call's tokens, copied
    out of the graph's capacity rows, so not its row count."""
    return (expert_output.dtype, tuple(expert_output.shape), output.dtype, output.shape[1], reduce,
            apply_router_weight_on_input)


class DispatchGraphs:
    """The graphs one all-to-all P/F (fixed blocks of ``capacity`` rows, Standard format) captured, by key.

    ``pf`` in the calls below is that :class:`AllToAllPrepareFinalize` (not imported here: it imports this module),
    whose ``_dispatch`` and ``_combine`` (the plain call's work) the graphs capture.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._captured: dict[tuple, Optional[_Captured]] = {}  # None: this key runs eagerly (capture failed, gloo)
        self._released = False
        _LIVE.add(self)

    def release(self) -> None:
        """Free this P/F's graphs; its later calls run plainly (:func:`release_graphs` says when and why)."""
        for key, captured in self._captured.items():
            if captured is not None:
                captured.graph.reset()
                for combine_key, found in captured.finalize.items():
                    if found is not None:
                        found[0].reset()
                    captured.finalize[combine_key] = None
            self._captured[key] = None
        self._released = True

    @staticmethod
    def applies(device: torch.device) -> bool:
        """The switches every call checks: CUDA with the compiled kernels, not switched off, the caller not capturing."""
        return (device.type == "cuda" and HAS_TRITON and not interpreter_enabled() and enabled_by_env()
                and not torch.cuda.is_current_stream_capturing())

    def prepare(
        self,
        pf: PrepareFinalize,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        expert_map: torch.Tensor,
        apply_router_weight_on_input: bool,
        quantize: Optional[InputQuantizer],
    ) -> Optional[PreparedTokens]:
        """The prepared tokens from a replay, or None where the plain call must run (module docstring)."""
        if self._released or not self.applies(hidden_states.device):
            return None
        fused = pf._fused_fp8_rows(hidden_states, quantize)
        if quantize is not None and fused is None:
            return None  # a quantizer the graph would freeze, or one that would see the padding rows
        lane_key = _lane(hidden_states.device)
        lane = _lane_state(lane_key)
        key = prepare_key(lane_key, hidden_states, topk_weights, topk_ids, apply_router_weight_on_input, fused)
        if key in self._captured:
            captured = self._captured[key]
        else:  # captured whether or not tokens are held: every rank captures on the same call
            captured = self._captured[key] = self._capture_prepare(
                pf, lane, hidden_states, topk_weights, topk_ids, expert_map, apply_router_weight_on_input, quantize)
        if captured is None or lane.outstanding():
            return None
        num_tokens = captured.inputs.copy_in(hidden_states, topk_weights, topk_ids)
        captured.graph.replay()
        prepared = captured.prepared
        # the use counts with nothing handed out, read again on each replay (a reference the capture left to be
        # collected later would otherwise hide an alias), before the aliases below
        lane.last = (prepared, _use_counts(prepared))
        handed = PreparedTokens(
            hidden=prepared.hidden.detach(),
            scale=prepared.scale.detach() if prepared.scale is not None else None,
            topk_ids=prepared.topk_ids.detach(),
            topk_weights=prepared.topk_weights.detach(),
            expert_num_tokens=prepared.expert_num_tokens.detach() if prepared.expert_num_tokens is not None else None,
            state=ReplayedDispatch(captured, num_tokens),
        )
        return handed

    def finalize(
        self,
        pf: PrepareFinalize,
        output: torch.Tensor,
        expert_output: torch.Tensor,
        prepared: PreparedTokens,
        *,
        apply_router_weight_on_input: bool,
        reduce: WeightAndReduce,
    ) -> bool:
        """Finalize tokens a replay prepared (True when done here); False for tokens the plain prepare made."""
        state = prepared.state
        if not isinstance(state, ReplayedDispatch):
            return False
        captured = state.captured
        if output.shape[0] != state.num_tokens:
            raise KernelInputError(f"{pf.name}.finalize: the output has {output.shape[0]} rows but prepare was "
                                   f"called with {state.num_tokens} tokens")
        key = finalize_key(expert_output, output, reduce, apply_router_weight_on_input)
        if self._released or not self.applies(expert_output.device):
            found = None
        elif key in captured.finalize:
            found = captured.finalize[key]
        else:
            found = captured.finalize[key] = self._capture_finalize(pf, captured, key, expert_output, output,
                                                                    apply_router_weight_on_input, reduce)
        if found is None:
            # The plain combine on the replay's tokens, into a static output of the capacity's rows as the graph's
            # (the prepared tokens' slots address capacity rows).
            full = output.new_empty((self.capacity, output.shape[1]))
            pf._combine(full, expert_output, captured.prepared, apply_router_weight_on_input=apply_router_weight_on_input,
                        reduce=reduce)
            output.copy_(full[: state.num_tokens])
            return True
        graph, expert_in, out = found
        expert_in.copy_(expert_output)
        graph.replay()
        output.copy_(out[: state.num_tokens])
        return True

    def _capture_prepare(self, pf, lane: _Lane, hidden, weights, ids, expert_map, on_input: bool,
                         quantize) -> Optional[_Captured]:
        if dist.get_backend(pf.group) != "nccl":
            return None
        inputs = lane.inputs(self.capacity, hidden, weights, ids)
        world = pf.placement.world_size
        local_map = pf._local_map(expert_map)  # made outside the capture; the graph reads it

        def body() -> PreparedTokens:
            return pf._dispatch(inputs.hidden, inputs.topk_weights, inputs.topk_ids, num_experts=pf.placement.num_experts,
                                expert_map=expert_map, apply_router_weight_on_input=on_input, quantize=quantize,
                                world=world, buffers=None)

        inputs.copy_in(hidden, weights, ids)
        graph, prepared = _capture(pf, lane, body, "the dispatch")
        if graph is None:
            return None
        return _Captured(lane, graph, inputs, prepared, local_map)

    def _capture_finalize(self, pf, captured: _Captured, key: tuple, expert_output, output, on_input: bool, reduce):
        lane = captured.lane
        expert_in = lane.static("expert_output", tuple(expert_output.shape), expert_output.dtype)
        out = lane.static("output", (self.capacity, output.shape[1]), output.dtype)
        expert_in.copy_(expert_output)

        def body() -> None:
            pf._combine(out, expert_in, captured.prepared, apply_router_weight_on_input=on_input, reduce=reduce)

        graph, _ = _capture(pf, lane, body, "the combine")
        return (graph, expert_in, out) if graph is not None else None


def _use_counts(prepared: PreparedTokens) -> dict[int, int]:
    """Storage address -> use count, for the storages of the tensors a replay hands out (aliases not yet made)."""
    counts = {}
    for t in (prepared.hidden, prepared.scale, prepared.topk_ids, prepared.topk_weights, prepared.expert_num_tokens):
        if t is not None:
            storage = t.untyped_storage()._cdata
            counts[storage] = torch._C._storage_Use_Count(storage)
    return counts


def _capture(pf, lane: _Lane, body, what: str):
    """(graph, what the captured ``body`` returned), or (None, None) on every rank where any rank's capture failed.

    ``body`` runs once uncaptured on the lane's capture stream first (the collectives run: every rank does this on
    the same call), then is captured into the lane's pool. A warm-up that raises is the plain call's error and
    propagates; a capture that fails becomes a warning and eager calls for this key, agreed by an all-reduce.
    """
    device = lane.device
    caller = torch.cuda.current_stream(device)
    lane.stream.wait_stream(caller)
    graph, result, failure = torch.cuda.CUDAGraph(), None, ""
    with torch.cuda.stream(lane.stream):
        body()
        # the warm-up's collectives finished before the capture begins (once per key), as torch.cuda.graph does
        torch.cuda.synchronize(device)
        collecting = gc.isenabled()
        gc.disable()  # a collection during the capture could free tensors whose frees the graph would record
        try:
            graph.capture_begin(pool=lane.pool, capture_error_mode="thread_local")
            try:
                result = body()
            finally:
                graph.capture_end()
        except Exception as err:  # noqa: BLE001 - whatever stops one rank's capture, every rank must learn it below
            failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        finally:
            if collecting:
                gc.enable()
    caller.wait_stream(lane.stream)
    failed = torch.tensor([1.0 if failure else 0.0], device=device)
    dist.all_reduce(failed, group=pf.group)
    if failed.item():
        warnings.warn(f"moe_fsm: {pf.name}: {what} could not be captured in a CUDA graph "
                      f"({failure or 'on another rank'}); its calls run eagerly", RuntimeWarning, stacklevel=4)
        return None, None
    return graph, result
