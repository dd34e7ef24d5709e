{
  "build": {
    "because": "moe-fsm implements TritonExperts",
    "experts": "TritonExperts",
    "how": "native",
    "prepare_finalize_because": null,
    "prepare_finalize_buildable": true,
    "runnable": true
  },
  "events": [
    {
      "event": "guard",
      "guard": "explicit_request",
      "inputs": {
        "requested": "auto",
        "source": "backend"
      },
      "result": false,
      "step": "explicit_user_choice"
    },
    {
      "event": "guard",
      "guard": "flashinfer_env",
      "inputs": {
        "env": [
          {
            "name": "VLLM_USE_FLASHINFER_MOE_FP16",
            "raw": null,
            "set": false,
            "value": false
          }
        ],
        "test": "reads 1"
      },
      "result": false,
      "step": "flashinfer_preference"
    },
    {
      "event": "guard",
      "guard": "auto_scan",
      "inputs": {},
      "result": true,
      "step": "auto_scan"
    },
    {
      "dest": "auto_scan",
      "event": "transition",
      "source": "start",
      "trigger": "advance"
    },
    {
      "candidates": [
        "AITER",
        "TRITON",
        "BATCHED_TRITON"
      ],
      "event": "scan"
    },
    {
      "backend": "AITER",
      "event": "candidate",
      "kernel": null,
      "kernels": [
        {
          "failed": [
            "it is not enabled \u2014 set VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_MOE=1 to enable it"
          ],
          "kernel": "AiterExperts",
          "supported": false
        }
      ],
      "reason": "it is not enabled \u2014 set VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_MOE=1 to enable it",
      "supported": false
    },
    {
      "backend": "TRITON",
      "event": "candidate",
      "kernel": "TritonExperts",
      "kernels": [
        {
          "failed": [],
          "kernel": "TritonExperts",
          "supported": true
        }
      ],
      "reason": null,
      "supported": true
    },
    {
      "event": "prepare_finalize",
      "name": "AllGatherReduceScatterPrepareFinalize",
      "reason": "dp_size=2 with expert parallelism (tp_size=1, dp_size=2, ep_size=2): tokens travel by all-gather and reduce-scatter (allgather_reducescatter); each rank computes only its own experts' slots (standard format, expert map)"
    },
    {
      "dest": "selected",
      "event": "transition",
      "source": "auto_scan",
      "trigger": "advance"
    }
  ],
  "family": "unquantized",
  "inputs": {
    "env": {
      "VLLM_USE_FLASHINFER_MOE_FP8": "1"
    },
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
      "capability": null,
      "device_name": "AMD Instinct MI300X",
      "gcn_arch": "gfx942",
      "libraries": [
        "aiter",
        "triton",
        "vllm._custom_ops"
      ],
      "vendor": "rocm"
    },
    "profile": {
      "name": "seeds",
      "reason": "no vLLM distribution is installed beside moe-fsm: the seed snapshot moe-fsm is specified from"
    },
    "request": "auto"
  },
  "layer_name": null,
  "outcome": {
    "activation_format": "standard",
    "backend": "TRITON",
    "kernel": "TritonExperts",
    "prepare_finalize": {
      "activation_format": "standard",
      "buildable": true,
      "group_size": 2,
      "kind": "allgather_reducescatter",
      "name": "AllGatherReduceScatterPrepareFinalize",
      "not_buildable_because": null,
      "reason": "dp_size=2 with expert parallelism (tp_size=1, dp_size=2, ep_size=2): tokens travel by all-gather and reduce-scatter (allgather_reducescatter); each rank computes only its own experts' slots (standard format, expert map)",
      "uses_expert_map": true
    },
    "status": "selected",
    "via": "auto_scan"
  },
  "path": [
    "start",
    "auto_scan",
    "selected"
  ],
  "schema": "moe-fsm/decision-trace",
  "schema_version": 1,
  "volatile": {
    "duration_us": 208.1,
    "host": "vm",
    "moe_fsm_version": "0.1.0",
    "pid": 12800,
    "python": "3.11.7",
    "started_at": 1795463527.790275
  }
}
