"""The wheel: strategies, repack, zip copy, metadata, provenance, setup.py builds, verify, diff."""
