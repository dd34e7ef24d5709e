"""Eager experts calls replayed from CUDA graphs: a layer call's launch work paid once per shape.

An eager one-token call of the Triton experts launches five or six kernels through torch's
dispatcher and Triton's Python launcher, which costs the host 100-200 µs for ~35 µs of device
work (``docs/perf/transformers.md``): an eager model forward then waits on the host, and a
model that enables moe-fsm decodes slower than transformers' one-GEMM ``batched_mm``. Here a
call signature seen twice is captured once into a CUDA graph per layer; later calls copy their
three inputs into static buffers, replay the graph and return a copy of its output: three
host operations whatever the kernel launches inside. Small calls whose inputs keep coming at the
same addresses (a decode loop: the caching allocator hands each layer the same blocks) get a
graph of their own that reads the inputs where they are and hands out its output: one host
operation (``EagerGraphs`` says when).

What a captured call shares and what it owns:

* Everything below is kept per *lane*, the calling thread's current stream on its device: graphs,
  static buffers, memory pool and capture stream. Within a lane the calls are ordered by the stream
  and by the thread; two lanes (an engine overlapping two batches on two streams, from one thread or
  two) share nothing a replay writes, so they may run at the same time. Captures are thread-local
  (``capture_error_mode="thread_local"``): another thread's allocations do not invalidate one.
* The static input and output buffers belong to the signature (token count, dtypes, top-k,
  lane), not to the layer: the layers of a model run one after another on one stream, so
  layer B's inputs are copied in only after layer A's replay and the copy of its output were
  queued.
* The graphs of one lane allocate their intermediates from one private memory pool. No graph
  keeps a pool allocation alive after its capture (each copies its result, inside the graph, into
  an output allocated outside the pool), so every graph may reuse every other graph's scratch:
  replays are ordered by the stream, and no data passes between graphs through scratch. An output
  kept in the pool would be scratch to a graph captured before it, and that graph's replay would
  overwrite it.
* A captured cuBLAS GEMM (a block's router) writes the cuBLAS workspace that torch keeps per stream;
  its address is fixed in the graph. torch frees those workspaces whenever anyone calls
  ``torch._C._cuda_clearCublasWorkspaces`` (Inductor's CUDA graph trees do before each warm-up and
  recording, so ``torch.compile(mode="reduce-overhead")`` does), and a graph that used a freed one
  writes into memory that is since someone else's: a compiled decoding step read corrupted indices,
  or the replay faulted (an illegal memory access in ``generate()`` after prefill blocks were
  captured, H200, ``docs/perf/transformers.md``). So each capture first drops the cached workspaces:
  the captured GEMMs allocate new ones inside the lane's pool, scratch like any other.
* The graph of a layer holds its weights by address: the key includes both weights' data
  pointers, so a replaced weight tensor is captured again, and in-place updates are seen.

Only kernels that read no device value on the host can be captured
(``ModularKernel.capturable``). A call is run eagerly, uncaptured, when the caller is itself
capturing (its graph takes the kernels), when its token count exceeds ``max_tokens``, before
the signature's second call (one-off prefill lengths are not worth a capture), and once
``max_signatures`` signatures exist on the device (memory stays bounded). A capture that
fails marks that kernel uncapturable for the process and the call runs eagerly: the graph
is a speed-up, never a new way to fail.

Switches: ``MOE_FSM_EAGER_GRAPHS=0`` turns replay off for the process; the transformers
integration's ``enable(model, eager_graphs=False)`` for one model. Pinned graphs serve calls of up
to ``MOE_FSM_EAGER_GRAPH_PINNED_MAX_TOKENS`` tokens (default 256; 0 turns them off).

``capture`` is the capture step itself, shared with whoever replays larger units from graphs in the
same pool (the transformers integration's MoE blocks: ``integrations/block_graphs.py``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

ENV = "MOE_FSM_EAGER_GRAPHS"
MAX_TOKENS_ENV = "MOE_FSM_EAGER_GRAPH_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 8192
DEFAULT_MAX_SIGNATURES = 64
PINNED_MAX_TOKENS_ENV = "MOE_FSM_EAGER_GRAPH_PINNED_MAX_TOKENS"
# above 256 tokens the kernels' device time hides a copy's host time
DEFAULT_PINNED_MAX_TOKENS = 256
DEFAULT_PINNED_PER_SIGNATURE = 4
MAX_SIGHTINGS = 4096  # input-address combinations counted towards a pinned capture
CAPTURE_ON_CALL = 2  # a signature is captured on its second call


def lane_of(device: torch.device) -> tuple[int, int, int]:
    """(device index, the caller's current stream on it, the calling thread): what the captured graphs' state is
    kept per (module docstring). Two threads on one stream are two lanes too: each call's copy in, replay and
    copy out are three host operations another thread's could fall between. The raw stream handle is read
    without building a ``torch.cuda.Stream``: this runs on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, torch._C._cuda_getCurrentRawStream(index), threading.get_ident()


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


def max_tokens_from_env(name: str = MAX_TOKENS_ENV, default: int = DEFAULT_MAX_TOKENS) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; accepted: a token count >= 0 (0: never capture)") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} is negative; accepted: a token count >= 0 (0: never capture)")
    return value


@dataclass
class _StaticIO:
    """The buffers every copying graph of one signature reads its inputs from and writes its output to."""

    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    out: torch.Tensor

    @property
    def inputs(self) -> list[torch.Tensor]:
        return [self.hidden, self.topk_weights, self.topk_ids]


@dataclass
class _PinnedGraph:
    """A graph that reads the caller's own input tensors (by address) and owns the output it returns."""

    graph: torch.cuda.CUDAGraph
    out: torch.Tensor  # never handed out itself: callers get a detached alias, which the use count sees
    storage: int  # the output storage's address for its use count
    unshared_count: int  # its use count while only this object holds the output

    def output_unshared(self) -> bool:
        """Whether no returned alias of the output is alive (nor a view or alias made from one: they all share
        its storage), so a replay may overwrite it."""
        return torch._C._storage_Use_Count(self.storage) == self.unshared_count


class EagerGraphs:
    """The captured graphs of eager experts calls, by (kernel handle, call signature).

    Two kinds, tried in this order:

    * pinned (token counts up to ``pinned_max_tokens``): captured on the second call whose three inputs sit
      at the same addresses with the same strides, reading them where they are; it owns its output and
      returns it as it is. A replay is one host operation. In a forward loop the caching allocator hands
      each layer the same blocks step after step, so decoding settles on pinned replays. A pinned output
      that something still holds (the tensor, a view or a detached alias of it) is never overwritten: the
      call takes the copying graph instead. At most ``pinned_per_signature`` per layer and signature.
    * copying: one per layer and signature; the inputs are copied into the signature's static buffers and
      the output copied out, three host operations.
    """

    def __init__(
        self,
        max_tokens: Optional[int] = None,
        max_signatures: int = DEFAULT_MAX_SIGNATURES,
        pinned_max_tokens: Optional[int] = None,
        pinned_per_signature: int = DEFAULT_PINNED_PER_SIGNATURE,
    ) -> None:
        self.max_tokens = max_tokens_from_env() if max_tokens is None else max_tokens
        self.max_signatures = max_signatures
        if pinned_max_tokens is None:
            pinned_max_tokens = max_tokens_from_env(PINNED_MAX_TOKENS_ENV, DEFAULT_PINNED_MAX_TOKENS)
        self.pinned_max_tokens = min(pinned_max_tokens, self.max_tokens)
        self.pinned_per_signature = pinned_per_signature
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pinned: dict[tuple, _PinnedGraph] = {}
        self._pinned_per_key: dict[tuple, int] = {}
        self._calls: dict[tuple, int] = {}
        self._sightings: dict[tuple, int] = {}
        self._io: dict[tuple, _StaticIO] = {}
        self._pools: dict[tuple[int, int, int], tuple] = {}
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}
        self._uncapturable: set[int] = set()

    @property
    def num_graphs(self) -> int:
        """Copying graphs (one per layer and signature)."""
        return len(self._graphs)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def call(
        self,
        handle: int,
        kernel,
        hidden: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: Optional[torch.Tensor],
    ) -> Optional[torch.Tensor]:
        """The call's output from a graph replay, or None when the caller must run it eagerly."""
        if torch.cuda.is_current_stream_capturing():  # the caller's graph takes the kernels themselves
            return None
        tokens = hidden.shape[0]
        io_key = (lane_of(hidden.device), tokens, hidden.shape[1], hidden.dtype, topk_ids.shape[1], topk_ids.dtype,
                  topk_weights.dtype)
        key = (handle, io_key, w1.data_ptr(), w2.data_ptr(), None if expert_map is None else expert_map.data_ptr())
        pin_key = None
        if tokens <= self.pinned_max_tokens:
            pin_key = (key, hidden.data_ptr(), hidden.stride(), topk_weights.data_ptr(), topk_weights.stride(),
                       topk_ids.data_ptr(), topk_ids.stride())
            pinned = self._pinned.get(pin_key)
            if pinned is not None and pinned.output_unshared():
                pinned.graph.replay()
                return pinned.out.detach()  # an alias of its own, so the storage's use count says who holds it
        graph = self._graphs.get(key)
        if graph is not None and (pin_key is None or pin_key in self._pinned or not self._pin_due(key, pin_key)):
            io = self._io[io_key]
            torch._foreach_copy_(io.inputs, [hidden, topk_weights, topk_ids])
            graph.replay()
            return io.out.clone()
        if handle in self._uncapturable or not 0 < tokens <= self.max_tokens:
            return None
        if graph is not None:  # a pinned graph is due for these addresses
            return self._capture_pinned(handle, kernel, key, pin_key, hidden, w1, w2, topk_weights, topk_ids, expert_map)
        calls = self._calls.get(key, 0) + 1
        self._calls[key] = calls
        if calls < CAPTURE_ON_CALL or (io_key not in self._io and len(self._io) >= self.max_signatures):
            return None
        return self._capture_copying(handle, kernel, key, io_key, hidden, w1, w2, topk_weights, topk_ids, expert_map)

    def _pin_due(self, key: tuple, pin_key: tuple) -> bool:
        """Count a sighting of these input addresses; True on the second while the layer has room for a pinned graph."""
        if self._pinned_per_key.get(key, 0) >= self.pinned_per_signature:
            return False
        if len(self._sightings) >= MAX_SIGHTINGS:  # addresses that never settle: forget them, keep memory bounded
            self._sightings.clear()
        seen = self._sightings.get(pin_key, 0) + 1
        self._sightings[pin_key] = seen
        return seen >= CAPTURE_ON_CALL

    def _capture_copying(self, handle, kernel, key, io_key, hidden, w1, w2, topk_weights, topk_ids, expert_map):
        io = self._io.get(io_key)
        if io is None:
            io = self._io[io_key] = _StaticIO(
                torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device),
                torch.empty(topk_weights.shape, dtype=topk_weights.dtype, device=hidden.device),
                torch.empty(topk_ids.shape, dtype=topk_ids.dtype, device=hidden.device),
                torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device),
            )
        torch._foreach_copy_(io.inputs, [hidden, topk_weights, topk_ids])

        def body():
            io.out.copy_(kernel(io.hidden, w1, w2, io.topk_weights, io.topk_ids, expert_map=expert_map, check_values=False))

        graph = self._capture_kernel(handle, kernel, hidden.device, body)
        if graph is None:
            return None
        self._graphs[key] = graph
        graph.replay()
        return io.out.clone()

    def _capture_pinned(self, handle, kernel, key, pin_key, hidden, w1, w2, topk_weights, topk_ids, expert_map):
        # the output lives outside the shared pool: a graph captured earlier may use the same pool memory as
        # scratch, and its replay would overwrite an output kept there (the H100 suite caught exactly that)
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)

        def body():
            out.copy_(kernel(hidden, w1, w2, topk_weights, topk_ids, expert_map=expert_map, check_values=False))

        graph = self._capture_kernel(handle, kernel, hidden.device, body)
        if graph is None:
            return None
        storage = out.untyped_storage()._cdata
        self._pinned[pin_key] = _PinnedGraph(graph, out, storage, torch._C._storage_Use_Count(storage))
        self._pinned_per_key[key] = self._pinned_per_key.get(key, 0) + 1
        self._sightings.pop(pin_key, None)
        graph.replay()
        return out.detach()

    def _capture_kernel(self, handle, kernel, device: torch.device, body) -> Optional[torch.cuda.CUDAGraph]:
        graph = self.capture(device, body, getattr(kernel, "name", kernel), "its eager calls launch their kernels directly from now on")
        if graph is None:
            self._uncapturable.add(handle)
        return graph

    def capture(self, device: torch.device, body, what, instead: str) -> Optional[torch.cuda.CUDAGraph]:
        """``body`` captured on a side stream into the device's pool, after one uncaptured run.

        None if the capture fails, with a warning that names ``what`` failed and what happens ``instead``.
        ``body`` must copy whatever its graph hands out into memory allocated outside the pool (see the
        module docstring).
        """
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream(device)
        lane = lane_of(device)
        side = self._side_stream(lane)
        side.wait_stream(caller)
        try:
            # capture_begin/end rather than torch.cuda.graph: that context synchronizes the device, collects
            # garbage and empties the allocator's cache on every capture, tens of ms for each layer of a model
            with torch.cuda.stream(side):
                # one uncaptured run first: whatever compiles or initializes lazily for these addresses (a
                # Triton specialization on 16-byte alignment) does it outside the capture
                body()
                # the GEMMs captured next allocate their cuBLAS workspace in the pool (module docstring)
                torch._C._cuda_clearCublasWorkspaces()
                with _no_garbage_collection():
                    graph.capture_begin(pool=self._pool(lane), capture_error_mode="thread_local")
                    try:
                        body()
                    finally:
                        graph.capture_end()
        except Exception as err:  # a kernel that reads the device on the host, or anything capture refuses
            caller.wait_stream(side)
            warnings.warn(
                f"moe_fsm: {what} could not be captured in a CUDA graph ({type(err).__name__}: {err}); {instead}",
                RuntimeWarning,
                stacklevel=5,
            )
            return None
        caller.wait_stream(side)
        return graph

    def _side_stream(self, lane: tuple[int, int, int]) -> torch.cuda.Stream:
        """The stream a lane's graphs are captured on (a capture needs a stream other than the legacy default)."""
        stream = self._streams.get(lane)
        if stream is None:
            stream = self._streams[lane] = torch.cuda.Stream(lane[0])
        return stream

    def _pool(self, lane: tuple[int, int, int]) -> tuple:
        pool = self._pools.get(lane)
        if pool is None:
            pool = self._pools[lane] = torch.cuda.graph_pool_handle()
        return pool

    def clear(self) -> None:
        """Drop every graph and buffer (their memory returns to the allocator's cache)."""
        self._graphs.clear()
        self._pinned.clear()
        self._pinned_per_key.clear()
        self._calls.clear()
        self._sightings.clear()
        self._io.clear()
        self._pools.clear()
        self._streams.clear()
        self._uncapturable.clear()


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's cyclic collector held off for the length of a capture.

    A collection that frees a CUDA graph kept alive only by a reference cycle (a model a test or a caller
    dropped) destroys the graph's executable, which CUDA refuses while a stream captures in the global mode
    torch uses: the capture is invalidated ("operation not permitted when stream is capturing", then
    cudaErrorStreamCaptureInvalidated), the allocator's pool is left recording and every later capture in the
    process fails. The H100 suite met exactly that once, depending on which tests a worker had run before.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

