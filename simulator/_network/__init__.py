"""The simulated network: how long a message takes and what c10d sees inside a simulation.

``_model`` holds :class:`~twinrpc.simulator.NetworkModel` (latency, jitter, bandwidth, failure
detection delays); ``_process_group`` keeps ``torch.distributed`` process groups per simulated worker
so programs that mix RPC with DDP run in one process.
"""
