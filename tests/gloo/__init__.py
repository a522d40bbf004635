"""The real world (impl/): its transport, launch and failures, in real processes on wall-clock time."""
