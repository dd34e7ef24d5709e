{
  "build": null,
  "events": [
    {
      "event": "guard",
      "guard": "explicit_request",
      "inputs": {
        "requested": "marlin",
        "source": "backend"
      },
      "result": true,
      "step": "explicit_user_choice"
    },
    {
      "dest": "explicit_user_choice",
      "event": "transition",
      "source": "start",
      "trigger": "advance"
    },
    {
      "dest": "failed",
      "event": "transition",
      "source": "explicit_user_choice",
      "trigger": "advance"
    }
  ],
  "family": "unquantized",
  "inputs": {
    "env": {},
    "layer": {
      "activation": "silu",
      "allow_vllm_cutlass": false,
      "dtype": "bfloat16",
      "hidden_size": 1024,
      "intermediate_size": 512,
      "lora": false,
      "num_experts": 8,
      "quant": {
        "activation": null,
        "family": "unquantized",
        "weight": null
      },
      "router_weight_on_input": false,
      "swiglu_limit": null,
      "top_k": 2
    },
    "parallel": {
      "all2all": "allgather_reducescatter",
      "batched_activation_format": false,
      "dp_size": 2,
      "ep_size": 2,
      "tp_size": 1
    },
    "platform": {
      "capability": [
        12,
        1
      ],
      "device_name": "NVIDIA GB10 (DGX Spark)",
      "gcn_arch": null,
      "libraries": [
        "flashinfer",
        "flashinfer.b12x_moe",
        "flashinfer.cutedsl_moe",
        "flashinfer.cutlass_fused_moe",
        "flashinfer.trtllm_fused_moe",
        "torch._grouped_mm",
        "torch._scaled_grouped_mm",
        "triton",
        "vllm._custom_ops"
      ],
      "vendor": "cuda"
    },
    "profile": {
      "name": "seeds",
      "reason": "no vLLM distribution is installed beside moe-fsm: the seed snapshot moe-fsm is specified from"
    },
    "request": "marlin"
  },
  "layer_name": null,
  "outcome": {
    "activation_format": "standard",
    "error": {
      "builtin": "ValueError",
      "message": "moe_backend='marlin' is not supported for Unquantized MoE. Expected one of ['triton', 'flashinfer_trtllm', 'flashinfer_cutlass', 'aiter', 'torch_grouped_mm'].",
      "type": "BackendUnsupportedError"
    },
    "status": "failed"
  },
  "path": [
    "start",
    "explicit_user_choice",
    "failed"
  ],
  "schema": "moe-fsm/decision-trace",
  "schema_version": 1,
  "volatile": {
    "duration_us": 26271.8,
    "host": "vm",
    "moe_fsm_version": "0.1.0",
    "pid": 10092,
    "python": "3.11.7",
    "started_at": 1795462918.973076
  }
}
