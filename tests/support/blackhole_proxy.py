"""A TCP proxy that can go silent without closing anything: a firewall drop, a failover without RST.

``blackhole()`` turns every connection open at that moment into a dead one for good: nothing is
forwarded either way, nothing is read, no socket is closed (the peer's kernel still ACKs, so TCP
keepalives on the client see a live peer, as with a hung server behind a live host). Connections
accepted while blackholed get the same treatment from their first byte. ``restore()`` lets new
connections through; the dead ones stay dead (the old primary never comes back), so a client only
recovers if it gives up on them. ``close()`` closes every socket.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from dataclasses import dataclass


@dataclass(eq=False)
class _Pair:
    client: socket.socket
    upstream: socket.socket | None
    dead: bool = False


class BlackholeProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._holed = False
        self._closed = threading.Event()
        self._pairs: list[_Pair] = []
        self.accepted = 0
        self.swallowed = 0  # connections that were (or became) dead
        self._thread = threading.Thread(target=self._accept_loop, name="blackhole-accept", daemon=True)

    def __enter__(self) -> BlackholeProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def blackhole(self) -> None:
        with self._lock:
            self._holed = True
            for pair in self._pairs:
                if not pair.dead:
                    pair.dead = True
                    self.swallowed += 1

    def restore(self) -> None:
        with self._lock:
            self._holed = False

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in (pair.client, pair.upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.2)
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                holed = self._holed
            upstream = None
            if not holed:
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                except OSError:
                    client.close()  # the database itself refuses: pass that on as it is
                    continue
            pair = _Pair(client=client, upstream=upstream, dead=holed)
            with self._lock:
                self._pairs.append(pair)
                if holed:
                    self.swallowed += 1
            if upstream is not None:
                threading.Thread(target=self._pump, args=(pair,), name="blackhole-pump", daemon=True).start()

    def _pump(self, pair: _Pair) -> None:
        assert pair.upstream is not None
        ends = {pair.client: pair.upstream, pair.upstream: pair.client}
        while not self._closed.is_set():
            with self._lock:
                dead = pair.dead
            if dead:  # hold everything, close nothing, until the proxy closes
                self._closed.wait(0.2)
                continue
            try:
                ready, _, _ = select.select(list(ends), [], [], 0.2)
            except (OSError, ValueError):
                return
            for src in ready:
                with self._lock:
                    if pair.dead:
                        break
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                if not data:  # an orderly close while forwarding: pass it on (only the blackhole is silent)
                    for s in ends:
                        with contextlib.suppress(OSError):
                            s.close()
                    with self._lock, contextlib.suppress(ValueError):
                        self._pairs.remove(pair)
                    return
                try:
                    ends[src].sendall(data)
                except OSError:
                    for s in ends:
                        with contextlib.suppress(OSError):
                            s.close()
                    return
