"""The address a rank publishes for others to connect to: torch.distributed's store, the weight channel, the
controller's sideband.

A node's host name often resolves to its management network (1 GbE) while the fast fabric (IPoIB, a second
Ethernet) has a name of its own or none; torch's gloo and NCCL bootstrap pick their interface by
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. So each rank works its own address out on its own node:
ROLLHPC_DIST_HOST (an address or name, as given) first, else the IPv4 address of the interface named by
ROLLHPC_DIST_IFNAME (``cluster.network_interface`` exports it, and the two torch variables beside it), else that
of GLOO_SOCKET_IFNAME when it names one plain interface, else the host name.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import psutil

__all__ = ["interface_address", "rendezvous_host"]


def interface_address(name: str) -> str | None:
    """The first IPv4 address of network interface ``name`` on this node; None if it has none or is unknown."""
    for addr in psutil.net_if_addrs().get(name, ()):
        if addr.family == socket.AF_INET:
            return addr.address
    return None


def rendezvous_host(environ: Mapping[str, str] = os.environ, fallback: str | None = None) -> str:
    """This rank's address for others to reach it at (the module docstring says in which order it is chosen);
    RuntimeError when a named interface does not exist here, rather than a rendezvous that hangs later."""
    if environ.get("ROLLHPC_DIST_HOST"):
        return environ["ROLLHPC_DIST_HOST"]
    named = environ.get("ROLLHPC_DIST_IFNAME")
    gloo = environ.get("GLOO_SOCKET_IFNAME", "")
    if not named and gloo and "," not in gloo:
        named = gloo
    if named:
        address = interface_address(named)
        if address is None:
            raise RuntimeError(
                f"network interface {named!r} (ROLLHPC_DIST_IFNAME / GLOO_SOCKET_IFNAME, "
                f"cluster.network_interface) has no IPv4 address on {socket.gethostname()}"
            )
        return address
    return fallback or socket.gethostname()
