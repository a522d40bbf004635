"""The command line, ``python -m twinrpc.simulator``: one module per subcommand.

``_main`` builds the parser from the subcommand modules (``run`` lives with the launcher in
``_launch/_launch.py``; ``_explore`` (with ``_shards``: ``explore --shard`` and ``explore merge``),
``_replay`` and ``_trace`` here), each of which provides
``register(subparsers)``.
"""
