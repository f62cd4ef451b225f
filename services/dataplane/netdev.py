"""Which network interface UCX may use: the one holding the address this process advertises.

UCX puts every interface's address into its worker address and may open lanes over any of
them; a peer then tries them all. In a swarm container one of them (eth on
`docker_gwbridge`, where containers may not talk to each other: icc off) drops the
connection attempt, and the first transfer never progresses (docs/deploy.md, "UCX between
containers"). The interface that the advertised name resolves to is the one peers reach us
by, so UCX gets that one alone (UCX_NET_DEVICES; shared memory is another family and stays).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable, Mapping

__all__ = ["advertised_net_device", "local_ipv4_interfaces", "net_device_for"]

_SIOCGIFADDR = 0x8915


def local_ipv4_interfaces() -> dict[str, str]:
    """Interface name -> its IPv4 address, for every interface that has one (Linux ioctl)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            out[name] = socket.inet_ntoa(raw[20:24])
    return out


def net_device_for(addresses: Iterable[str], interfaces: Mapping[str, str]) -> str | None:
    """The interface (of `interfaces`, name -> IPv4) holding one of `addresses`; None if the
    addresses are loopback (every UCX transport reaches a same-host peer) or not local (a
    NAT'd or forwarded name: nothing to learn from it, UCX keeps its defaults)."""
    by_ip = {ip: name for name, ip in interfaces.items()}
    for addr in addresses:
        ip = ipaddress.ip_address(addr)
        if ip.is_loopback or ip.is_unspecified:
            return None
        if addr in by_ip:
            return by_ip[addr]
    return None


def advertised_net_device(host: str | None) -> str | None:
    """The interface for `host` (the name or address peers reach this process by), or None."""
    if not host:
        return None
    try:
        infos = socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return net_device_for([str(info[4][0]) for info in infos], local_ipv4_interfaces())
