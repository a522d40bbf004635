"""``python -m twinrpc.simulator COMMAND ...`` (see :mod:`twinrpc.simulator._cli._main`)."""

import sys

from ._cli._main import main

sys.exit(main())
