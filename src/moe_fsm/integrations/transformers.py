"""moe-fsm inside Hugging Face transformers: its experts modules run the kernel moe-fsm decides.

transformers 5 dispatches every experts module decorated with
``use_experts_implementation`` through ``ExpertsInterface``:
``fn(module, hidden_states, top_k_index, top_k_weights)``. ``enable(model)``
registers ``moe_fsm`` there, then prepares every such module *at enable time*:
the layer spec comes from the module and its config, the per-layer
``Engine`` decides it (once per distinct spec: one trace per distinct decision, named
after its first module, and ``model.manifest`` mapping every module to its trace) and
builds the kernel. The forward only reads the module's own
``gate_up_proj`` / ``down_proj`` (views, never copies: they are moe-fsm's w1
[E, 2N, K] and w2 [E, K, N], or their transposes), so a forward never decides
again and weight updates are seen at once.

Layouts the kernels lack (expert biases, interleaved gate/up rows, a custom
gate, non-gated experts, a post-expert norm) are refused by ``enable``, naming
the model class and the feature. Transposed weights are taken as views.

Training: the torch experts are differentiable (autograd through their GEMMs,
activation and top-k reduction, router weights included). The Triton, grouped-GEMM
and FlashInfer experts are inference-only. When a forward needs gradients and a
layer's kernel is inference-only, ``training="torch"`` (the default) runs that
call on the torch experts of the same layer, built at enable; ``training="refuse"``
raises instead. ``EnabledModel.training_substitutes`` lists those layers. A call
needs gradients when grad mode is on and an input or weight requires them, as in
eager: run inference under ``torch.no_grad()`` or ``torch.inference_mode()`` (as
``generate()`` does) to get the decided kernel on every layer.

A decided kernel moe-fsm cannot build here (one it only models, like vLLM's
compiled CUTLASS, or a dtype its implementation lacks, like float32 for the Triton
kernels) is replaced by the torch experts of the same layer, and
``EnabledModel.substitutes`` / ``summary()`` say so and why; the trace keeps the decision.

Dropped experts: transformers marks a slot another rank computes with an id
>= num_experts; moe-fsm's convention is -1 plus an ``expert_map``. The conversion
happens here, at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from moe_fsm.decision import probed_platform
from moe_fsm.engine.engine import Engine, LoadedLayer
from moe_fsm.errors import BackendUnavailableError, InputError, KernelInputError, MoeFsmError
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts, Vendor
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.integrations.block_graphs import BlockGraphs
from moe_fsm.integrations.block_graphs import uninstall as uninstall_block
from moe_fsm.modular import ops
from moe_fsm.modular.eager_graphs import enabled_by_env
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.plan.decider import DEFAULT_TRACE_DIR
from moe_fsm.plan.model_config import ACTIVATIONS
from moe_fsm.profiles import ProfileChoice
from moe_fsm.runtime import build
from moe_fsm.trace.dir_lock import trace_dir_lock
from moe_fsm.trace.manifest import MODEL_MANIFEST_NAME, MODEL_MANIFEST_SCHEMA, layer_number, write_layer_manifest

IMPLEMENTATION = "moe_fsm"


# Experts classes whose forward is torch operators autograd can follow.
DIFFERENTIABLE_EXPERTS = frozenset({"TorchExperts", "TorchBatchedExperts"})

TRAINING_MODES = ("torch", "refuse")


@dataclass
class PreparedExperts:
    """What one experts module runs: its decided kernel, and the torch kernel for gradient-needing calls."""

    name: str
    layer: MoELayer
    loaded: LoadedLayer
    kernel: object
    training_kernel: Optional[object]
    device: torch.device
    substitute_reason: Optional[str] = None  # why the torch experts run instead of the decided kernel
    # fixed at enable, read by every call (plain fields: what a compiled graph guards on)
    dtype: Optional[torch.dtype] = None
    handle: int = -1  # moe_fsm::experts handle of ``kernel`` (with ``training_kernel`` for its backward)
    training_handle: int = -1  # the handle of ``training_kernel``, for calls that need gradients
    inference_only: bool = False
    eager_graphs: bool = False  # eager CUDA calls replay a CUDA graph per signature (modular/eager_graphs.py)

    def __post_init__(self) -> None:
        self.dtype = getattr(torch, self.layer.dtype)
        self._register()

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in ("kernel", "training_kernel") and self.handle >= 0:
            self._register()  # a replaced kernel gets its own operator handle

    def _register(self) -> None:
        """Register the kernels with ``moe_fsm::experts`` (once each: enable and any replacement)."""
        self.inference_only = self.kernel.experts.name not in DIFFERENTIABLE_EXPERTS
        differentiable = self.training_kernel if self.inference_only else self.kernel
        self.handle = ops.register(self.kernel, differentiable if isinstance(differentiable, ModularKernel) else None)
        if isinstance(self.training_kernel, ModularKernel):
            self.training_handle = ops.register(self.training_kernel, self.training_kernel)
        else:
            self.training_handle = -1


@dataclass
class EnabledModel:
    """The result of ``enable``: every prepared module, the engine that decided them, where the traces are."""

    model_class: str
    engine: Engine
    modules: dict[str, PreparedExperts]
    training: str
    blocks: Optional[BlockGraphs] = None  # the MoE blocks whose eager forwards replay from CUDA graphs

    @property
    def trace_dir(self) -> Path:
        return self.engine.trace_dir

    @property
    def substitutes(self) -> dict[str, str]:
        """Modules whose decided kernel moe-fsm cannot build here, which run the torch experts: name -> why."""
        return {name: p.substitute_reason for name, p in self.modules.items() if p.substitute_reason}

    @property
    def training_substitutes(self) -> list[str]:
        """Modules whose decided kernel is inference-only and that train through the torch experts."""
        return [name for name, p in self.modules.items() if p.inference_only and p.training_kernel is not None]

    def summary(self) -> str:
        groups: dict[tuple, list[str]] = {}
        for name, p in self.modules.items():
            d = p.loaded.decision
            runs = f"{p.kernel.experts.name} + {p.kernel.prepare_finalize.name}"
            key = (d.backend, runs, p.layer.dtype, p.inference_only, p.substitute_reason)
            groups.setdefault(key, []).append(name)
        lines = [
            f"moe_fsm: {len(self.modules)} experts module(s) of {self.model_class}, "
            f"{self.engine.distinct_decisions} distinct decision(s); traces in {self.trace_dir}/"
        ]
        for (backend, kernel, dtype, inference_only, substitute), names in groups.items():
            note = f"; {substitute}" if substitute else ""
            if inference_only:
                note += "; training: torch experts" if self.training == "torch" else "; training: refused"
            lines.append(f"  {len(names):3d} x {backend} ({kernel}, {dtype}{note}): {names[0]}" + (" ..." if len(names) > 1 else ""))
        if self.blocks is not None:
            lines.append(f"  {len(self.blocks.replays)} MoE block(s) replay router and experts from CUDA graphs in eager no-grad forwards")
        return "\n".join(lines)


def enable(
    model,
    backend: Union[str, Mapping[str, str], BackendRequest] = "auto",
    *,
    policy: Union[str, ProfileChoice, None] = None,
    env: Union[EnvSnapshot, Mapping[str, str], None] = None,
    trace_dir: Union[str, Path] = DEFAULT_TRACE_DIR,
    platform: Optional[PlatformFacts] = None,
    parallel: Optional[ParallelConfig] = None,
    training: str = "torch",
    eager_graphs: Optional[bool] = None,
) -> EnabledModel:
    """Register ``moe_fsm`` with transformers, decide and build every experts module, switch the model to it.

    ``policy`` names the profile whose rules decide ("seeds", "vllm-0.33", ...; None:
    the installed vLLM's, else seeds). ``platform`` defaults to the probed machine for modules on a GPU and to the
    CPU for modules on the CPU (the kernel must run where the weights are).
    ``eager_graphs`` (default: on unless ``MOE_FSM_EAGER_GRAPHS=0``): eager forwards on a GPU replay each
    capturable layer's call from a CUDA graph captured on the second call of each token count
    (``moe_fsm/modular/eager_graphs.py``): the same kernels, without their launch work on the host; and
    under ``torch.no_grad()`` the MoE block around such a layer (its router and experts) replays as one
    graph (``block_graphs.py``).
    Raises ``InputError`` naming the model class and feature for a layout
    moe-fsm cannot run, the first layer's selection error (trace written), and ``TraceWriteError`` when another
    process writes into ``trace_dir`` (a `moe-fsm run`, `plan` or enable() holds its lock) before it writes there.
    """
    from transformers.integrations.moe import ExpertsInterface

    if training not in TRAINING_MODES:
        raise InputError(f"training={training!r} is not one of {list(TRAINING_MODES)}")
    found = experts_modules(model)
    if not found:
        raise InputError(
            f"{type(model).__name__} has no experts module dispatched through transformers' ExpertsInterface "
            "(classes decorated with use_experts_implementation)"
        )
    device_types = sorted({_weights(module)[0].device.type for _, module in found})
    if len(device_types) > 1:
        raise InputError(
            f"the experts of {type(model).__name__} are spread over device types {device_types}; moe_fsm decides "
            "for one platform, so move the model to one device type before enable()"
        )
    specs = [(name, module, layer_spec(module, model_class=type(model).__name__, name=name)) for name, module in found]
    graphs = enabled_by_env() if eager_graphs is None else bool(eager_graphs)
    if graphs:
        ops.eager_graphs()  # reads its token limits from the environment now: a bad value fails enable(), not a forward
    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    engine = Engine(
        parallel=parallel, request=backend, env=env, policy=policy, build=False,
        platform=platform or platform_for(_weights(found[0][1])[0].device), trace_dir=trace_dir,
    )
    # One writer at a time in the trace directory (trace.dir_lock), as for `moe-fsm run` and `plan`: two processes
    # enabling models into one directory would write the same layer trace names, and each manifest would name traces
    # holding the other's decisions. Held from the first trace to the manifest; a second writer is refused at once.
    with trace_dir_lock(engine.trace_dir, flag="trace_dir"):
        prepared, kernels, torch_kernels = {}, {}, {}
        for name, module, layer in specs:
            loaded = engine.load_layer(name, layer)
            key = engine.inputs_for(layer)
            if key not in kernels:
                kernels[key] = build_kernel(loaded.decision, layer, engine, _weights(module)[0].device)
            kernel, substitute_reason = kernels[key]
            training_kernel = kernel if kernel.experts.name in DIFFERENTIABLE_EXPERTS else None
            if training_kernel is None and training == "torch":
                if layer not in torch_kernels:
                    torch_kernels[layer] = torch_kernel(layer)
                training_kernel = torch_kernels[layer]
            prepared[name] = module._moe_fsm = PreparedExperts(
                name, layer, loaded, kernel, training_kernel, _weights(module)[0].device, substitute_reason,
            )
            prepared[name].eager_graphs = graphs and getattr(kernel, "capturable", False)
        blocks = install_block_graphs(model, prepared) if graphs else uninstall_block_graphs(model, prepared)
        model.set_experts_implementation(IMPLEMENTATION)
        write_layer_manifest(
            engine.trace_dir, MODEL_MANIFEST_NAME, MODEL_MANIFEST_SCHEMA,
            {"model": type(model).__name__, "profile": engine.profile.to_json(), "platform": engine.platform.to_json()},
            [{"index": layer_number(name, i), "name": name, "trace": path.name}
             for i, (name, path) in enumerate(engine.layer_traces)],
        )
    return EnabledModel(type(model).__name__, engine, prepared, training, blocks)


def _blocks(model, prepared: Mapping[str, PreparedExperts]):
    """(name, MoE block, experts module name) for each prepared experts module: the block is the module's
    parent, which calls its router and it."""
    for name in prepared:
        parent = name.rpartition(".")[0]
        if parent:
            yield parent, model.get_submodule(parent), name


def install_block_graphs(model, prepared: Mapping[str, PreparedExperts]) -> Optional[BlockGraphs]:
    """Replay from CUDA graphs the eager forward of every block whose experts kernel is capturable."""
    blocks = BlockGraphs(ops.eager_graphs())
    for name, block, experts_name in _blocks(model, prepared):
        if prepared[experts_name].eager_graphs:
            config = model.get_submodule(experts_name).config
            blocks.install(block, name, lambda config=config: config._experts_implementation == IMPLEMENTATION)
        else:
            uninstall_block(block)
    return blocks if blocks.replays else None


def uninstall_block_graphs(model, prepared: Mapping[str, PreparedExperts]) -> None:
    for _, block, _ in _blocks(model, prepared):
        uninstall_block(block)


def experts_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every module transformers dispatches through ExpertsInterface."""
    return [
        (name, module) for name, module in model.named_modules()
        if hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and hasattr(module, "down_proj")
    ]


def layer_spec(module, *, model_class: str, name: str) -> MoELayer:
    """The MoELayer of one experts module, or InputError listing every feature the kernels lack."""
    from transformers.integrations.moe import _default_apply_gate

    cls = type(module)
    unsupported = []
    if getattr(module, "has_bias", False):
        unsupported.append("expert biases (gate_up_proj_bias, down_proj_bias)")
    if not getattr(module, "is_concatenated", True):
        unsupported.append("interleaved gate/up rows (moe-fsm takes all gate rows, then all up rows)")
    if not getattr(module, "has_gate", True):
        unsupported.append("non-gated experts (up_proj only)")
    if getattr(module, "has_post_expert_norm", False):
        unsupported.append("a norm after each expert")
    if getattr(cls, "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        unsupported.append(f"a custom gate ({cls.__name__}._apply_gate)")
    config = module.config
    act = getattr(config, "hidden_act", None)
    if act not in ACTIVATIONS:
        unsupported.append(f"activation hidden_act={act!r} (moe-fsm runs {sorted(ACTIVATIONS)})")
    w1, w2 = _weights(module) if hasattr(module, "gate_up_proj") else (None, None)
    if w1 is None:
        unsupported.append("no gate_up_proj weight")
    elif not w1.is_floating_point() or w1.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        unsupported.append(f"expert weights of dtype {w1.dtype} (quantized experts are not mapped yet)")
    if unsupported:
        raise InputError(
            f"{model_class}: experts module {name} ({cls.__name__}) has " + "; ".join(unsupported)
            + ". moe_fsm runs gate_up_proj [E, 2I, H] (gate rows first, or its transpose) and down_proj [E, H, I] "
            "with no biases and a gated silu/gelu"
        )
    top_k = next((getattr(config, k) for k in ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")
                  if isinstance(getattr(config, k, None), int)), None)
    if top_k is None:
        raise InputError(f"{model_class}: the config of {name} names no top-k (num_experts_per_tok)")
    num_experts, two_n, hidden = w1.shape
    if w2.shape != (num_experts, hidden, two_n // 2) or two_n % 2:
        raise InputError(
            f"{model_class}: {name} has gate_up_proj {list(w1.shape)} and down_proj {list(w2.shape)} "
            "(as w1/w2); expected [E, 2I, H] and [E, H, I]"
        )
    return MoELayer(
        num_experts=num_experts, top_k=top_k, hidden_size=hidden, intermediate_size=two_n // 2,
        activation=ACTIVATIONS[act], dtype=w1.dtype,
    )


def platform_for(device: torch.device) -> PlatformFacts:
    """The machine's facts for a GPU device; for the CPU, a CPU platform with this machine's libraries."""
    probed = probed_platform()
    if device.type == "cpu":
        return replace(probed, vendor=Vendor.CPU, capability=None, gcn_arch=None, device_name="cpu")
    return probed


def build_kernel(decision, layer: MoELayer, engine: Engine, device: torch.device) -> tuple[object, Optional[str]]:
    """The decided kernel; where moe-fsm cannot build it here (a kernel it only models, a dtype its
    implementation lacks, a CUDA kernel for a model on the CPU), the stand-in ``build`` names, else the torch
    experts of the same layer, with the reason."""
    try:
        kernel = build(decision, engine.registry, device=device.type)
    except (BackendUnavailableError, KernelInputError) as err:
        return torch_kernel(layer), f"{decision.kernel or decision.backend} cannot be built here ({err}); runs the moe-fsm torch experts"
    if kernel.stand_in is None:
        return kernel, None
    return kernel, f"{kernel.stand_in.describe(decision.kernel or decision.backend)}: {kernel.stand_in.because}"


def torch_kernel(layer: MoELayer):
    """The torch experts of ``layer`` behind a local prepare/finalize: the kernel for calls that need gradients."""
    from moe_fsm.experts.torch_experts import TorchExperts
    from moe_fsm.modular.kernel import ModularKernel
    from moe_fsm.prepare_finalize.local import LocalPrepareFinalize

    return ModularKernel(LocalPrepareFinalize(), TorchExperts(layer), layer)


def moe_fsm_ids(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' dropped-slot ids (>= num_experts) to moe-fsm's (-1, with an identity expert map)."""
    dropped = top_k_index >= num_experts
    ids = torch.where(dropped, torch.full_like(top_k_index, -1), top_k_index)
    return ids, torch.arange(num_experts, device=top_k_index.device, dtype=torch.int32)


def experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``moe_fsm`` entry of ExpertsInterface: run the module's prepared kernel on its own weights.

    Everything here reads metadata and attributes fixed at enable (no tensor value), so
    ``torch.compile`` traces it whole; the kernel itself is the ``moe_fsm::experts``
    operator while dynamo traces, a direct call in eager (``moe_fsm.modular.ops.call``).
    """
    prepared: Optional[PreparedExperts] = getattr(module, "_moe_fsm", None)
    if prepared is None:
        raise MoeFsmError(
            f"{type(module).__name__} was not prepared by moe_fsm: call moe_fsm.integrations.transformers.enable(model) "
            "after loading (and again after adding modules)"
        )
    w1, w2 = _weights(module)
    if w1.device != prepared.device or w1.dtype != prepared.dtype:
        raise MoeFsmError(
            f"{prepared.name} moved to {w1.device} / {w1.dtype} after enable() decided it for {prepared.device} / "
            f"{prepared.layer.dtype}; call enable(model) again"
        )
    kernel, handle = prepared.kernel, prepared.handle
    needs_grad = torch.is_grad_enabled() and (
        hidden_states.requires_grad or w1.requires_grad or w2.requires_grad or top_k_weights.requires_grad
    )
    if needs_grad and prepared.inference_only:
        if prepared.training_kernel is None:
            raise MoeFsmError(
                f"{prepared.name}: {kernel.experts.name} is inference-only and enable(training='refuse') was asked; "
                "run under torch.no_grad(), or enable with training='torch'"
            )
        kernel, handle = prepared.training_kernel, prepared.training_handle
    ids, expert_map = top_k_index, None
    if getattr(module, "_is_expert_parallel", False):
        ids, expert_map = moe_fsm_ids(top_k_index, prepared.layer.num_experts)
    x = hidden_states if hidden_states.dtype == w1.dtype else hidden_states.to(w1.dtype)
    out = ops.call(handle, kernel, x, w1, w2, top_k_weights, ids, expert_map,
                   graphs=prepared.eager_graphs and handle == prepared.handle)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def _weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """w1 [E, 2N, K] and w2 [E, K, N] as views of the module's parameters (transposed layouts included)."""
    w1, w2 = module.gate_up_proj, module.down_proj
    if getattr(module, "is_transposed", False):
        return w1.transpose(1, 2), w2.transpose(1, 2)
    return w1, w2

