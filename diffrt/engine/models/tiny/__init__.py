"""Tiny seeded diffusers folders, one builder module per family, built
offline from the shared pieces in ``shared``."""
