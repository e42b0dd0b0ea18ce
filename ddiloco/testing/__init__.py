"""Helpers for tests of ddiloco and of code built on it: runs of the real launchers, process
checks, an in-memory object store, and one-shot twins of the codecs and the wire stack. Not
imported by the library itself."""
