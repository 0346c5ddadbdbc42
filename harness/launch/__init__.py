"""The launch: supervised workers, the fork server, the compile farm and shared compiles."""
