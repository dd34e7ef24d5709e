"""Integrations with other engines (optional dependencies, imported only when used)."""
