"""Loads the conformance plugin (conformance/_harness/plugin.py) for the tests in this folder.

Hooks and the ``world`` fixture are re-exported rather than listed in ``pytest_plugins`` because
pytest only allows ``pytest_plugins`` in the rootdir conftest.
"""

from conformance._harness.plugin import *  # noqa: F403
