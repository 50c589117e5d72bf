"""Bind a server's listening socket before anything slow happens, so a port clash is one clear line."""

from __future__ import annotations

import socket

from collm.common.errors import UserError


def bind_listen_socket(host: str, port: int, field: str = "api.port") -> socket.socket:
    """A bound TCP socket on host:port (IPv6 if the host has a colon), or a UserError naming `field`."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"{field}: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def is_loopback(host: str) -> bool:
    """True if a server bound to `host` is reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
