"""The judge: one case run on one kernel, and its verdict with evidence."""
