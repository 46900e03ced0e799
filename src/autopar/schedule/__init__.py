"""Placement, per-device programs, and their simulation: what runs where, when."""
