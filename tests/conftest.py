"""Tests import helpers as ``tests.*``; the repository root is on sys.path via rootdir conftest."""
