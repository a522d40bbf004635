"""``python -m twinrpc.simulator COMMAND ...`` (see :mod:`twinrpc.simulator._cli`)."""

import sys

from ._cli import main

sys.exit(main())
