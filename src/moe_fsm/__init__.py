"""moe-fsm: choose and run the MoE experts kernel for a layer, as an explicit state machine."""

__version__ = "0.1.0"
