"""Helpers for tests of ddiloco and of code built on it: runs of the real launchers, process
checks, an in-memory object store, one-shot twins of the codecs and the wire stack, and a round
merged both ways by the syncer (for merge rules). Not imported by the library itself."""
