"""The HTTP address, taken before anything loads: `bullet launch` binds its sockets first, so a port
in use or a host that is not this machine's is one clear line at once — not a uvicorn log line after
the model has loaded, the workers have started and (on a first launch) the estimator profile has been
measured. The sockets are bound, not listening: a client that connects while the model loads is
refused as before, and uvicorn starts listening on them once the application is up."""

from __future__ import annotations

import errno
import socket


class ListenError(ValueError):
    """The address cannot be served; the message says why and what to pass instead."""


def address_label(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets as URLs write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: OSError, host: str, port: int) -> str:
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host '{host}' ({exc.strerror}); --host takes an address or a name of this machine"
    if exc.errno == errno.EADDRINUSE:
        return "the port is in use (another server?); pick another --port, or --port 0 for a free one"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine; --host takes one of its addresses, or 0.0.0.0 for all"
    if exc.errno == errno.EACCES:
        return f"permission denied (port {port} is below 1024, which needs privileges)" if 0 < port < 1024 \
            else "permission denied"
    return exc.strerror or str(exc)


def bind_http_sockets(host: str, port: int) -> list[socket.socket]:
    """One bound TCP socket per address `host` resolves to (a name such as `localhost` may have an
    IPv4 and an IPv6 one, as asyncio would serve both), all on the same port; port 0 takes a free one
    on the first and keeps it for the rest. Raises `ListenError` and leaves nothing bound on failure.
    The sockets are not inherited by child processes (Python's default), so no worker holds the port."""
    label = address_label(host, port)
    bound: list[socket.socket] = []
    try:
        try:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise ListenError(f"cannot listen on {label}: {_reason(exc, host, port)}") from None
        seen: set[tuple] = set()
        for family, kind, proto, _, address in infos:
            if (family, address[:2]) in seen:
                continue
            seen.add((family, address[:2]))
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart within TIME_WAIT binds
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # :: beside 0.0.0.0, as asyncio does
            if port == 0 and len(bound) > 1:
                address = (address[0], bound[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as exc:
                raise ListenError(f"cannot listen on {label}: {_reason(exc, host, port)}") from None
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound


def bound_port(sockets: list[socket.socket]) -> int:
    """The port the sockets hold (the free one the kernel chose for --port 0)."""
    return sockets[0].getsockname()[1]
