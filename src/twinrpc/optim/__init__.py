"""twinrpc."""
