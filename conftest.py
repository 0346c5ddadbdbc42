"""Root conftest: choose GPU or Triton's interpreter before any kernel import."""
from harness.backend import choose_backend

choose_backend()
