{
  "build": null,
  "events": [
    {
      "event": "guard",
      "guard": "when",
      "inputs": {
        "when": [
          {
            "condition": "LoRA enabled",
            "holds": false,
            "reason": "LoRA is off"
          }
        ]
      },
      "result": false,
      "step": "lora_shortcut"
    },
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
      "backend": "MARLIN",
      "event": "mapped",
      "requested": "marlin"
    },
    {
      "backend": "MARLIN",
      "event": "candidate",
      "kernel": null,
      "kernels": [
        {
          "failed": [
            "needs a cuda device, this is cpu (cpu)",
            "vllm._custom_ops is not installed (not importable on this platform)"
          ],
          "kernel": "MarlinExperts",
          "supported": false
        }
      ],
      "reason": "needs a cuda device, this is cpu (cpu)",
      "supported": false
    },
    {
      "dest": "failed",
      "event": "transition",
      "source": "explicit_user_choice",
      "trigger": "advance"
    }
  ],
  "family": "fp8",
  "inputs": {
    "env": {},
    "layer": {
      "activation": "silu",
      "allow_vllm_cutlass": false,
      "dtype": "float32",
      "hidden_size": 1024,
      "intermediate_size": 512,
      "lora": false,
      "num_experts": 8,
      "quant": {
        "activation": {
          "dtype": "fp8_e4m3",
          "granularity": "group1x128",
          "static": false
        },
        "family": "fp8",
        "weight": {
          "dtype": "fp8_e4m3",
          "granularity": "tensor",
          "static": true
        }
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
      "capability": null,
      "device_name": "cpu",
      "gcn_arch": null,
      "libraries": [],
      "vendor": "cpu"
    },
    "profile": {
      "name": "seeds",
      "reason": "no vLLM distribution is installed beside moe-fsm: the seed snapshot moe-fsm is specified from"
    },
    "request": "marlin"
  },
  "layer_name": "R",
  "outcome": {
    "activation_format": "standard",
    "error": {
      "builtin": "ValueError",
      "message": "FP8 MoE backend MARLIN does not support the deployment configuration since needs a cuda device, this is cpu (cpu).",
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
    "duration_us": 244.9,
    "host": "vm",
    "moe_fsm_version": "0.1.0",
    "pid": 12800,
    "python": "3.11.7",
    "started_at": 1795463384.90203
  }
}
