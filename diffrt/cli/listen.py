"""The listening socket of ``diffrt serve``, bound before anything loads.

A port out of range, an address this machine does not have, or a port in
use is one line and exit status 2 at once, not uvicorn's ERROR line (status
3) after minutes of loading a model, nor a server that loaded and listens on
nothing.
"""

from __future__ import annotations

import errno
import socket

from diffrt.cli.errors import CliError

#: connections the kernel queues before uvicorn accepts them (uvicorn's default)
BACKLOG = 2048


def check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise CliError(f"--port {port}: must be 0-65535 (0: a free port)")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (SO_REUSEADDR, as
    uvicorn binds), or CliError naming the flag at fault."""
    check_port(port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise CliError(f"--host {host}: not an address or a name that resolves "
                       f"({getattr(exc, 'strerror', None) or exc})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise CliError(_bind_error(host, port, exc)) from None
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"--port {port}: already in use on {host} (stop what listens there, or pick " \
               "another port; 0 picks a free one)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    if exc.errno == errno.EACCES:
        return f"--port {port}: binding it needs privileges (use a port above 1023)"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
