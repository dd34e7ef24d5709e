"""Eager experts calls replayed from CUDA graphs: a layer call's launch work paid once per shape.

An eager one-token call of the Triton experts launches five or six kernels through torch's
dispatcher and Triton's Python launcher, which costs the host 100-200 µs for ~35 µs of device
work (``docs/perf/transformers.md``): an eager model forward then waits on the host, and a
model that enables moe-fsm decodes slower than transformers' one-GEMM ``batched_mm``. Here a
call signature seen twice is captured once into a CUDA graph per layer; later calls copy their
three inputs into static buffers, replay the graph and return a copy of its output: three
host operations whatever the kernel launches inside.

What a captured call shares and what it owns:

* The static input and output buffers belong to the signature (token count, dtypes, top-k,
  device), not to the layer: the layers of a model run one after another on one stream, so
  layer B's inputs are copied in only after layer A's replay and the copy of its output were
  queued. Calls of one device are assumed to come from one stream at a time (as a model's
  forward does); two threads calling layers concurrently on two streams must turn this off.
* The graphs of one device allocate their intermediates from one private memory pool. No
  graph keeps a pool allocation alive after its capture (its output is copied into the
  static buffer inside the graph), so every graph may reuse every other graph's scratch:
  replays are ordered by the stream, and no data passes between graphs through scratch.
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
integration's ``enable(model, eager_graphs=False)`` for one model.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

ENV = "MOE_FSM_EAGER_GRAPHS"
MAX_TOKENS_ENV = "MOE_FSM_EAGER_GRAPH_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 8192
DEFAULT_MAX_SIGNATURES = 64
CAPTURE_ON_CALL = 2  # a signature is captured on its second call


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


def max_tokens_from_env() -> int:
    raw = os.environ.get(MAX_TOKENS_ENV)
    if raw is None:
        return DEFAULT_MAX_TOKENS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_TOKENS_ENV}={raw!r} is not an integer; accepted: a token count >= 0 (0: never capture)") from None
    if value < 0:
        raise ValueError(f"{MAX_TOKENS_ENV}={raw!r} is negative; accepted: a token count >= 0 (0: never capture)")
    return value


@dataclass
class _StaticIO:
    """The buffers every graph of one signature reads its inputs from and writes its output to."""

    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    out: torch.Tensor

    @property
    def inputs(self) -> list[torch.Tensor]:
        return [self.hidden, self.topk_weights, self.topk_ids]


class EagerGraphs:
    """The captured graphs of eager experts calls, by (kernel handle, call signature)."""

    def __init__(self, max_tokens: Optional[int] = None, max_signatures: int = DEFAULT_MAX_SIGNATURES) -> None:
        self.max_tokens = max_tokens_from_env() if max_tokens is None else max_tokens
        self.max_signatures = max_signatures
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._calls: dict[tuple, int] = {}
        self._io: dict[tuple, _StaticIO] = {}
        self._pools: dict[int, tuple] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._uncapturable: set[int] = set()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

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
        io_key = (hidden.device, tokens, hidden.shape[1], hidden.dtype, topk_ids.shape[1], topk_ids.dtype, topk_weights.dtype)
        key = (handle, io_key, w1.data_ptr(), w2.data_ptr(), None if expert_map is None else expert_map.data_ptr())
        graph = self._graphs.get(key)
        if graph is not None:
            io = self._io[io_key]
            torch._foreach_copy_(io.inputs, [hidden, topk_weights, topk_ids])
            graph.replay()
            return io.out.clone()
        if handle in self._uncapturable or not 0 < tokens <= self.max_tokens:
            return None
        calls = self._calls.get(key, 0) + 1
        self._calls[key] = calls
        if calls < CAPTURE_ON_CALL or (io_key not in self._io and len(self._io) >= self.max_signatures):
            return None
        return self._capture(handle, kernel, key, io_key, hidden, w1, w2, topk_weights, topk_ids, expert_map)

    def _capture(self, handle, kernel, key, io_key, hidden, w1, w2, topk_weights, topk_ids, expert_map):
        io = self._io.get(io_key)
        if io is None:
            io = self._io[io_key] = _StaticIO(
                torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device),
                torch.empty(topk_weights.shape, dtype=topk_weights.dtype, device=hidden.device),
                torch.empty(topk_ids.shape, dtype=topk_ids.dtype, device=hidden.device),
                torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device),
            )
        torch._foreach_copy_(io.inputs, [hidden, topk_weights, topk_ids])
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream(hidden.device)
        side = self._side_stream(hidden.device)
        side.wait_stream(caller)
        try:
            # capture_begin/end rather than torch.cuda.graph: that context synchronizes the device, collects
            # garbage and empties the allocator's cache on every capture, tens of ms for each layer of a model
            with torch.cuda.stream(side):
                # one uncaptured run on the static buffers first: whatever compiles or initializes lazily for
                # their addresses (a Triton specialization on 16-byte alignment) does it outside the capture
                kernel(io.hidden, w1, w2, io.topk_weights, io.topk_ids, expert_map=expert_map, check_values=False)
                graph.capture_begin(pool=self._pool(hidden.device))
                try:
                    result = kernel(io.hidden, w1, w2, io.topk_weights, io.topk_ids, expert_map=expert_map, check_values=False)
                    io.out.copy_(result)
                    del result
                finally:
                    graph.capture_end()
        except Exception as err:  # a kernel that reads the device on the host, or anything capture refuses
            self._uncapturable.add(handle)
            caller.wait_stream(side)
            warnings.warn(
                f"moe_fsm: {getattr(kernel, 'name', kernel)} could not be captured in a CUDA graph "
                f"({type(err).__name__}: {err}); its eager calls launch their kernels directly from now on",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        caller.wait_stream(side)
        self._graphs[key] = graph
        graph.replay()
        return io.out.clone()

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(index)
        return stream

    def _pool(self, device: torch.device) -> tuple:
        index = device.index if device.index is not None else torch.cuda.current_device()
        pool = self._pools.get(index)
        if pool is None:
            pool = self._pools[index] = torch.cuda.graph_pool_handle()
        return pool

    def clear(self) -> None:
        """Drop every graph and buffer (their memory returns to the allocator's cache)."""
        self._graphs.clear()
        self._calls.clear()
        self._io.clear()
        self._pools.clear()
        self._streams.clear()
        self._uncapturable.clear()
