"""Loads the conformance plugin (conformance/harness/plugin.py) for the tests in this folder.

Hooks and the ``world`` fixture are re-exported rather than listed in ``pytest_plugins`` because
pytest only allows ``pytest_plugins`` in the rootdir conftest.
"""

from conformance.harness.plugin import *  # noqa: F403
