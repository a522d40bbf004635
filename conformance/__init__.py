"""twinrpc's conformance suite: one set of test bodies run against several RPC backends.

This is a package (not a loose test folder) so that worker programs defined in the test modules
have an importable dotted name (``conformance.test_smoke.program``): the torch backend pickles them
by reference and re-imports them in its worker processes.
"""
