"""Adapter modules that end, kill, hang or interrupt the process importing them, before any Kernel exists."""
