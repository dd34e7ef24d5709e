"""The experts call as registered torch operators: what ``torch.compile`` sees of a moe-fsm layer.

A built modular kernel reads routing on the host (the torch experts group pairs by
expert with ``.tolist()``, validation checks ids on the CPU), which dynamo cannot trace:
``torch.compile(model, fullgraph=True)`` stopped with "Could not guard on data-dependent
expression". Registered as custom operators, the call is one opaque node whose output
shape the fake implementation gives from the input shapes alone, so dynamo, AOTAutograd
and Inductor take the whole model forward with moe-fsm's layers inside it, and CUDA
graphs (``mode="reduce-overhead"``) capture the kernels the operator launches.

``moe_fsm::experts(hidden, w1, w2, topk_weights, topk_ids, expert_map, handle) -> [M, K]``
runs the kernel registered under ``handle`` (:func:`register`, once per built kernel, at
build or enable time); the handle is a constant of the traced graph, so the call path
holds no lookup by shape or configuration. Its output has hidden's shape and dtype, as
``ModularKernel.__call__``'s does.

Autograd (``register_autograd``): the backward is a second opaque operator,
``moe_fsm::experts_backward``, which recomputes the forward through the differentiable
torch experts registered with the kernel (``backward_kernel``) and returns the
gradients autograd gives there, for hidden states, w1, w2 and the router weights (as
the eager torch experts give them). The recomputation costs one more forward per
layer in the backward; kernels registered without a differentiable twin (Triton,
grouped GEMM, FlashInfer) refuse a backward with a reason. Not supported: double
backward, and the quantized layers' ``ExpertScales`` (the transformers integration
maps unquantized experts only; the operator has no scale arguments).

Eager callers need not go through the dispatcher: a Python custom operator costs
15-25 µs of host time per call on a CPU, more than the target for a whole one-token
layer, so :func:`call` takes the operator only while dynamo traces
(``torch.compiler.is_compiling()``) and calls the kernel directly otherwise, or, for an
eager CUDA call of a capturable kernel with ``graphs=True``, replays it from a CUDA graph
(``eager_graphs.py``). All run the same kernel object on the same arguments. Neither reads routing values to check
them (``check_values=False``: the ids come from a router's top-k, in range by
construction; an id out of range contributes nothing): shapes, dtypes and devices are
checked once per call signature.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from moe_fsm.errors import MoeFsmError
from moe_fsm.modular.eager_graphs import EagerGraphs
from moe_fsm.modular.validation import validate_call


@dataclass(frozen=True)
class RegisteredKernel:
    """What a handle names: the kernel the operator runs, and the differentiable kernel its backward recomputes."""

    kernel: object
    backward_kernel: Optional[object]


_REGISTERED: list[RegisteredKernel] = []
_HANDLES: dict[tuple[int, int], int] = {}
_LOCK = threading.Lock()


def register(kernel, backward_kernel=None) -> int:
    """The handle of ``kernel`` (with the differentiable ``backward_kernel`` of the same layer, or None).

    The same pair gets the same handle. Registered kernels live as long as the process
    (a compiled graph holds their handle as a constant, so they must not be freed under it).
    """
    key = (id(kernel), id(backward_kernel))
    with _LOCK:
        handle = _HANDLES.get(key)
        if handle is None or _REGISTERED[handle].kernel is not kernel or _REGISTERED[handle].backward_kernel is not backward_kernel:
            handle = len(_REGISTERED)
            _REGISTERED.append(RegisteredKernel(kernel, backward_kernel))
            _HANDLES[key] = handle
        return handle


def registered(handle: int) -> RegisteredKernel:
    if not 0 <= handle < len(_REGISTERED):
        raise MoeFsmError(f"no moe-fsm kernel is registered under handle {handle} (moe_fsm.modular.ops.register gives them)")
    return _REGISTERED[handle]


@torch.library.custom_op("moe_fsm::experts", mutates_args=())
def experts(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    handle: int,
) -> torch.Tensor:
    """The registered kernel's ``[M, K]`` output for this call."""
    return registered(handle).kernel(hidden, w1, w2, topk_weights, topk_ids, expert_map=expert_map, check_values=False)


@experts.register_fake
def _experts_fake(hidden, w1, w2, topk_weights, topk_ids, expert_map, handle):
    # shapes, dtypes and devices are checked while tracing (values are not: they are not known yet)
    kernel = registered(handle).kernel
    validate_call(kernel.layer, hidden, w1, w2, topk_weights, topk_ids, _scales(), expert_map, values=False)
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("moe_fsm::experts_backward", mutates_args=())
def experts_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    handle: int,
    hidden_grad: bool,
    w1_grad: bool,
    w2_grad: bool,
    weights_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``experts`` for the inputs asked for (each one not asked for is an empty tensor)."""
    kernel = registered(handle).backward_kernel
    if kernel is None:
        raise MoeFsmError(
            f"{registered(handle).kernel.name} is inference-only and was registered without differentiable torch experts; "
            "run it under torch.no_grad(), or register the layer's torch experts as its backward_kernel"
        )
    needs = (hidden_grad, w1_grad, w2_grad, weights_grad)
    inputs = (hidden, w1, w2, topk_weights)
    with _autograd_inside_operator(), torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        out = kernel(*leaves, topk_ids, expert_map=expert_map, check_values=False)
        wanted = [t for t, need in zip(leaves, needs) if need]
        if wanted and not out.requires_grad:
            raise MoeFsmError(f"{kernel.name} gave an output autograd cannot differentiate; its backward needs the torch experts")
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
    result = []
    for t, need in zip(inputs, needs):
        g = next(grads) if need else None
        if g is None:
            g = torch.zeros_like(t, memory_format=torch.contiguous_format) if need else t.new_empty(0)
        result.append(g.contiguous())
    return tuple(result)


@experts_backward.register_fake
def _experts_backward_fake(grad, hidden, w1, w2, topk_weights, topk_ids, expert_map, handle, hidden_grad, w1_grad, w2_grad, weights_grad):
    return tuple(
        t.new_empty(t.shape) if need else t.new_empty(0)
        for t, need in zip((hidden, w1, w2, topk_weights), (hidden_grad, w1_grad, w2_grad, weights_grad))
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden, w1, w2, topk_weights, topk_ids, expert_map, handle = inputs
    ctx.save_for_backward(hidden, w1, w2, topk_weights, topk_ids, expert_map)
    ctx.handle = handle


def _backward(ctx, grad):
    hidden, w1, w2, topk_weights, topk_ids, expert_map = ctx.saved_tensors
    needs = tuple(bool(n) for n in ctx.needs_input_grad[:4])
    grads = torch.ops.moe_fsm.experts_backward(grad, hidden, w1, w2, topk_weights, topk_ids, expert_map, ctx.handle, *needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None)


experts.register_autograd(_backward, setup_context=_setup_context)


class _autograd_inside_operator:
    """Let autograd record inside an operator's implementation.

    The dispatcher runs a custom operator's kernel with the autograd dispatch keys
    excluded (it is below autograd), so ``enable_grad()`` alone records nothing there;
    the backward's recomputation needs them back for its duration. Restores the
    thread's dispatch key sets on exit.
    """

    _KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")

    def __enter__(self):
        exclude = torch._C._dispatch_tls_local_exclude_set()
        for name in self._KEYS:
            key = getattr(torch._C.DispatchKey, name, None)
            if key is not None:
                exclude = exclude.remove(key)
        self._guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
        self._guard.__enter__()
        return self

    def __exit__(self, *exc):
        return self._guard.__exit__(*exc)


def _scales():
    from moe_fsm.modular.interfaces import ExpertScales

    return ExpertScales()


_eager_graphs: Optional[EagerGraphs] = None


def eager_graphs() -> EagerGraphs:
    """The process's captured eager calls (``eager_graphs.py``), made on first use."""
    global _eager_graphs
    if _eager_graphs is None:
        _eager_graphs = EagerGraphs()
    return _eager_graphs


def call(
    handle: int,
    kernel,
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor] = None,
    *,
    graphs: bool = False,
) -> torch.Tensor:
    """One experts call: through ``moe_fsm::experts`` while dynamo traces, straight to ``kernel`` in eager.

    ``graphs`` (eager CUDA calls of a capturable kernel): replay the call from a CUDA graph captured per
    signature (``eager_graphs.py``), the same kernels with a fraction of the host work.
    """
    if torch.compiler.is_compiling():
        return torch.ops.moe_fsm.experts(hidden, w1, w2, topk_weights, topk_ids, expert_map, handle)
    if graphs and hidden.is_cuda:
        out = eager_graphs().call(handle, kernel, hidden, w1, w2, topk_weights, topk_ids, expert_map)
        if out is not None:
            return out
    return kernel(hidden, w1, w2, topk_weights, topk_ids, expert_map=expert_map, check_values=False)
