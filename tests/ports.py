"""Free TCP ports for the servers tests start: free on every address, since Ray's
agents listen on the node's IP alone, where a probe bound to 127.0.0.1 sees nothing
(a port it called free reached another cluster's runtime-env agent once)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
