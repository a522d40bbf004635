"""The trace of a run and everything that reads it.

``_trace`` records events on the hot path and saves and loads them (the gloo world writes the same
format from ``impl/_trace.py``), ``_observer`` turns RRef and autograd hooks into trace events,
``_diff`` finds where two traces first differ, and ``_export*`` render a trace for viewers (text,
HTML, Perfetto, ShiViz). ``_data`` holds the plain values they share (an event, its message, a
trace read back whole, a divergence), below all of them and below the simulator's errors.
"""
