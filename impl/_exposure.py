"""What a gloo worker's listening ports are exposed to, prepared for at ``init_rpc``.

* **Idle connections.** gloo keeps every connection to a pair's listener that no pair has claimed, and
  aborts the process when ``accept()`` fails (it does when the process runs out of descriptors): about
  a thousand idle connections kill a worker under the common soft limit of 1,024 open files. The soft
  limit is raised to the hard limit here, which makes the attack cost that many more connections; it
  does not remove it (that is gloo's), and binding gloo to a private interface (``GLOO_SOCKET_IFNAME``)
  keeps strangers from connecting at all.
* **No key.** Without a job key, anyone who reaches a worker's ports can run code on it (every frame
  is unpickled). A worker rendezvousing on an address other than loopback says so once per process.
"""

from __future__ import annotations

import ipaddress
import logging
import resource
import socket

_log = logging.getLogger("twinrpc.impl")

#: the one warning of a keyless worker reachable from other hosts (logged once per process)
KEYLESS_WARNING = (
    "twinrpc: this worker has no authentication key and rendezvouses on %s, which is not a loopback "
    "address: anyone who can reach its rendezvous store or its gloo ports can run code in this process. "
    "Give the job a key (RpcBackendOptions(auth_key=...), TWINRPC_AUTH_KEY_FILE or TWINRPC_AUTH_KEY; see "
    "docs/howto/authenticate-workers.md) or keep the ports on a private network"
)


class _Warned:
    keyless = False


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files (RLIMIT_NOFILE) to its hard limit, so that idle
    connections to gloo's listeners exhaust it later (see the module docstring). Returns the soft
    limit before and after; a limit that cannot be raised is left as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit the kernel caps (fs.nr_open)
        return soft, soft
    return soft, hard


def warn_if_keyless_and_reachable(host: str | None, keyed: bool) -> bool:
    """Log KEYLESS_WARNING once per process when a worker without a key rendezvouses on ``host`` (None:
    a ``file://`` store) and ``host`` is not a loopback address. Returns whether it was logged now."""
    if keyed or host is None or _Warned.keyless or _is_loopback(host):
        return False
    _Warned.keyless = True
    _log.warning(KEYLESS_WARNING, host)
    return True


def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (an unresolvable host: True, the
    rendezvous reports it)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return True
    return all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)
