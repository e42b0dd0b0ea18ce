"""Helpers for tests of ddiloco and of code built on it: runs of the real launchers, process
checks, and an in-memory object store. Not imported by the library itself."""
