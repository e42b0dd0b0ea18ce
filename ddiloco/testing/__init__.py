"""Helpers for tests of ddiloco and of code built on it: runs of the real launchers, process
checks, an in-memory object store, one-shot twins of the codecs and the wire stack, a round merged
both ways by the syncer (for merge rules), learners for protocol tests, and the test tiers
(`tiers`, a pytest plugin). Not imported by the library itself."""
