"""The protocol core (src/twinrpc/) below the RPC API, with no world or a fake one."""
