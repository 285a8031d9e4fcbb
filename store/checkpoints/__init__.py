"""Checkpoint directories: layout, manifests, the one publication protocol and retention.
Imports `live`, `sqlite` and the foundation."""
