"""Integrations of treeverify's kernels into other engines (each imports its engine lazily)."""
