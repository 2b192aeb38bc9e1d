"""A TCP proxy in front of a daemon that can lose an answer: armed, it cuts both
connections at the daemon's next response HEADERS frame, so the daemon has run the call
and the client never hears of it (it sees UNAVAILABLE)."""

from __future__ import annotations

import contextlib
import socket
import threading

_HEADERS = 0x1  # HTTP/2 frame type


class CutProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.armed = 0  # answers still to lose
        self.cuts = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._forward, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        self._close(src, dst)

    def _answers(self, upstream: socket.socket, client: socket.socket) -> None:
        """Daemon -> client, frame by frame (9-byte HTTP/2 frame headers; the client's
        connection preface only goes the other way)."""
        buf = b""
        try:
            while data := upstream.recv(65536):
                buf += data
                out = b""
                while len(buf) >= 9:
                    size = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + size:
                        break
                    kind, stream = buf[3], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                    frame, buf = buf[: 9 + size], buf[9 + size :]
                    if self.armed and kind == _HEADERS and stream:
                        self.armed -= 1
                        self.cuts += 1
                        if out:
                            client.sendall(out)
                        self._close(client, upstream)
                        return
                    out += frame
                if out:
                    client.sendall(out)
        except OSError:
            pass
        self._close(upstream, client)
