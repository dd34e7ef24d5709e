"""Deployment planning from a checkpoint's config.json (decision core: no torch)."""
