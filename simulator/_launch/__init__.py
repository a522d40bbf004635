"""Unchanged programs as simulated processes (``python -m twinrpc.simulator run``).

``_launch`` runs a program file as N simulated workers, as torchrun does; ``_program`` gives each
simulated process its own modules, environment and output; ``_processes`` serves the
``multiprocessing`` processes a program starts; ``_torch`` points ``torch.distributed.rpc`` at twinrpc
for the run; ``_determinism`` runs a program twice and compares the runs.
"""
