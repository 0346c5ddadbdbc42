"""Adapters for kernel layouts unlike vLLM's, written against nanfuzz's public contract alone.

Each module imports ``nanfuzz`` (never ``nanfuzz.harness`` or ``nanfuzz.reference``),
torch and Triton, as a user's adapter would:

- ``token_index``: a decode kernel over a flat token index (page size 1, kv_indptr /
  kv_indices, SGLang's layout) whose window argument cannot express a window of one key;
- ``uniform_decode``: a paged decode kernel that takes one query length for the whole
  batch (speculative decoding's draft tokens);
- ``flat_pages``: plain torch reading the paged cache through a flat list of page ids.
"""
