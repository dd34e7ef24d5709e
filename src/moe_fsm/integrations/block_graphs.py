"""A transformers MoE block's eager forward, router and experts together, replayed from one CUDA graph.

With the experts call replayed from a graph (``modular/eager_graphs.py``), an eager one-token
forward still pays the host for the block's router: a linear, a softmax, a top-k, a sum, a
division and a cast, each a dispatched torch operator, around 50 µs a layer on an H100's host,
more than the experts call itself. No experts implementation can remove that: the experts
interface gets the router's result. Replaying the whole block (transformers' own router code,
then moe-fsm's kernels) from one graph does: the input is copied into a static buffer, the graph
replays, the output is copied out, three host operations a layer.

A block is replayed only where that gives what its eager forward gives:

* its experts module's kernel is capturable (``PreparedExperts.eager_graphs``), the model still
  dispatches that module to moe-fsm (not to an implementation set since), and the block is the
  experts module's parent, called with one tensor and no keyword arguments, returning one tensor;
* grad mode is off (``torch.no_grad()``, ``inference_mode``, ``generate()``): a graph records no
  autograd history;
* the block is in eval mode (a router's training-time jitter stays eager);
* no forward hook is set on the block or its modules (a hook would not run on a replay) but
  transformers' output recorder's, no global module hook is set, and that recorder collects nothing
  in this forward (``output_router_logits=True`` and the like read the router's hooks);
* the caller is neither compiling (dynamo traces the original forward) nor capturing a graph of
  its own (its graph takes the kernels);
* the token count is at most the experts' ``max_tokens`` and the same signature (input shape,
  strides, dtype, device, every parameter's and buffer's address: a replaced weight, router bias
  or direct submodule is captured again; in-place updates are read by the replay) was seen once before.

A replay reruns the block's device work only: a block whose forward changed Python state from call
to call would not see it change. transformers' MoE blocks compute from their input, parameters and
buffers alone (the one exception known, Mixtral's router jitter, runs only in training mode).

Otherwise the block's own forward runs, whose experts call may still replay the experts' graph.
A capture that fails (a block whose code reads the device on the host) warns once and leaves that
block eager for the process. The graphs share the experts graphs' memory pools and capture step; the
static input and output buffers are shared by every block of one signature (blocks run one after
another on one stream, the output is copied out before the next block's input is copied in). Graphs,
buffers and pools are kept per lane, the calling thread's current stream (``eager_graphs.py``): blocks
called on two streams at once share nothing a replay writes.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.nn.modules import module as nn_module

from moe_fsm.modular.eager_graphs import CAPTURE_ON_CALL, DEFAULT_MAX_SIGNATURES, EagerGraphs, lane_of

try:  # transformers 5's output recorder: a forward sets a collector, with a key for each output asked for
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - another transformers: nothing to ask
    _active_collector = None

REPLAY_ATTRIBUTE = "_moe_fsm_block_replay"  # on the installed forward: the BlockReplay behind it
# the name of the hook transformers' recorder installs (on first use) on the modules whose outputs it can collect;
# it collects only while the collector asks for its key
RECORDER_HOOK = "output_capturing_hook"


def _collecting() -> bool:
    """Whether transformers' recorder collects outputs in this forward (router logits, hidden states, ...)."""
    return _active_collector is not None and bool(_active_collector.get())


def _hook_count(modules: tuple[torch.nn.Module, ...]) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)


def _foreign_hooks(modules: tuple[torch.nn.Module, ...]) -> bool:
    """Whether a hook other than transformers' recorder's is set on any of ``modules``."""
    return any(getattr(hook, "__name__", None) != RECORDER_HOOK
               for m in modules for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))


def _global_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


class _BlockIO:
    """The static input and output every block graph of one signature reads and writes."""

    def __init__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.x = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        self.out = torch.empty_like(out)


class BlockGraphs:
    """The replayed MoE blocks of one enabled model and the static buffers they share, by signature."""

    def __init__(self, graphs: EagerGraphs, max_signatures: int = DEFAULT_MAX_SIGNATURES) -> None:
        self.graphs = graphs  # the pool, the capture step and the token limit, shared with the experts graphs
        self.max_signatures = max_signatures
        self.replays: dict[str, BlockReplay] = {}
        self._io: dict[tuple, _BlockIO] = {}

    @property
    def num_graphs(self) -> int:
        return sum(r.num_graphs for r in self.replays.values())

    def install(self, block: torch.nn.Module, name: str, active: Callable[[], bool]) -> "BlockReplay":
        """Replace ``block``'s forward with a replay of its own forward (a second install replaces the first).

        ``active()`` says, call by call, whether the block's experts run moe-fsm's kernel (a model switched to
        another experts implementation runs its blocks eagerly: a graph would replay moe-fsm's kernels).
        """
        uninstall(block)
        replay = BlockReplay(self, block, block.forward, name, active)

        def forward(*args, **kwargs):
            if torch.compiler.is_compiling():  # dynamo traces the block's own forward
                return replay.forward(*args, **kwargs)
            return replay(*args, **kwargs)

        setattr(forward, REPLAY_ATTRIBUTE, replay)
        block.forward = forward
        self.replays[name] = replay
        return replay

    def io(self, x: torch.Tensor, out: torch.Tensor) -> _BlockIO:
        key = (x.shape, x.stride(), x.dtype, lane_of(x.device), out.shape, out.dtype)
        io = self._io.get(key)
        if io is None:
            io = self._io[key] = _BlockIO(x, out)
        return io


class BlockReplay:
    """One block's graphs, by signature: what its installed forward replays."""

    def __init__(self, owner: BlockGraphs, block: torch.nn.Module, forward: Callable, name: str,
                 active: Callable[[], bool]) -> None:
        self.owner = owner
        self.active = active
        self.block = block
        self.forward = forward  # the block's own forward (bound), what every graph captures
        self.name = name
        self._survey()
        self.replayable = True
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, _BlockIO]] = {}
        self._calls: dict[tuple, int] = {}

    def _survey(self) -> None:
        """What the signature and the hook check read: the block's modules, parameters, buffers and hooks."""
        self.children = tuple(self.block._modules.items())
        self.modules = tuple(self.block.modules())
        self._hooks_seen = _hook_count(self.modules)
        self._foreign = _foreign_hooks(self.modules)
        # (module, name) of every parameter and buffer, read afresh each call: a replaced tensor is a new signature
        self.tensors = tuple((m, n) for m in self.modules for table in (m._parameters, m._buffers)
                             for n, t in table.items() if t is not None)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, *args, **kwargs):
        if kwargs or len(args) != 1 or not self._may_replay(args[0]):
            return self.forward(*args, **kwargs)
        x = args[0]
        key = (x.shape, x.stride(), x.dtype, lane_of(x.device), tuple(getattr(m, n).data_ptr() for m, n in self.tensors))
        entry = self._graphs.get(key)
        if entry is not None:
            graph, io = entry
            io.x.copy_(x)
            graph.replay()
            return io.out.clone()
        calls = self._calls.get(key, 0) + 1
        self._calls[key] = calls
        if calls < CAPTURE_ON_CALL or len(self._graphs) >= self.owner.max_signatures:
            return self.forward(x)
        return self._capture(key, x)

    def _may_replay(self, x) -> bool:
        return (isinstance(x, torch.Tensor) and x.is_cuda and self.eligible(x)
                and not torch.cuda.is_current_stream_capturing())

    def eligible(self, x: torch.Tensor) -> bool:
        """Whether a graph gives what the block's forward gives for ``x`` (on any device; the replay needs CUDA)."""
        return (
            self.replayable
            and self.active()
            and x.dim() > 0
            and not torch.is_grad_enabled()
            and not self.block.training
            and 0 < x.numel() // max(x.shape[-1], 1) <= self.owner.graphs.max_tokens
            and not _collecting()
            and not _global_hooks()
            and not self._hooked()
        )

    def _resurvey_if_replaced(self) -> None:
        """A submodule replaced since (a router swapped for another) brings its own tensors and hooks."""
        modules = self.block._modules
        if len(modules) != len(self.children) or any(modules.get(n) is not m for n, m in self.children):
            self._survey()

    def _hooked(self) -> bool:
        """Whether a hook that a replay would skip is set in the block (rechecked when the hooks change)."""
        self._resurvey_if_replaced()
        count = _hook_count(self.modules)
        if count != self._hooks_seen:
            self._hooks_seen = count
            self._foreign = _foreign_hooks(self.modules)
        return self._foreign

    def _capture(self, key: tuple, x: torch.Tensor):
        out = self.forward(x)
        if not isinstance(out, torch.Tensor):  # a block that also returns its router logits: left eager
            self.replayable = False
            return out
        io = self.owner.io(x, out)
        io.x.copy_(x)

        def body():
            io.out.copy_(self.forward(io.x))

        graph = self.owner.graphs.capture(x.device, body, f"the MoE block {self.name}", "it runs eagerly from now on")
        if graph is None:
            self.replayable = False
            return out
        self._graphs[key] = (graph, io)
        return out


def installed(block: torch.nn.Module) -> Optional[BlockReplay]:
    """The replay installed on ``block``, or None."""
    return getattr(block.__dict__.get("forward"), REPLAY_ATTRIBUTE, None)


def uninstall(block: torch.nn.Module) -> Optional[BlockReplay]:
    """Give ``block`` its own forward back; the removed replay, or None if it had none."""
    replay = installed(block)
    if replay is not None:
        del block.forward
    return replay
