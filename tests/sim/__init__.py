"""The simulator: fault plans, crashes, traces, exploration, its command line, plugin and models."""
