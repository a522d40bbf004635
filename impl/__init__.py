"""twinrpc.impl: the real multiprocess world over gloo process groups (issue #3, in progress)."""
