"""Turning float experts and activations into the FP8 and NVFP4 forms the kernels consume."""
