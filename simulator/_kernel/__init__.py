"""The kernel: the scheduler that runs simulated tasks on virtual time, one at a time.

It owns the event queue and its seeded tie-break (``_scheduler``), the compute model that charges
virtual time for torch operators (``_compute``), the replacement of the wall clock, sleep and thread
start while a task runs (``_virtual_time``) and ``current()``, the simulation the running task is in
(``_current``). Nothing above this layer switches tasks or reads a clock.
"""
