"""Hypothesis properties on the simulator: generated workloads under generated schedules and faults."""
