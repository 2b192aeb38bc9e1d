"""A TCP proxy in front of a daemon that injects connection faults frame by frame: it cuts
a call before it reaches the daemon, after it went out whole, or by losing its answer;
breaks a response stream midway; holds answers; refuses connections."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS = 0x0, 0x1  # HTTP/2 frame types
_END_STREAM = 0x1  # flag


class FaultProxy:
    """A TCP proxy in front of a daemon that injects connection faults, frame by frame.

    - `cut_requests`: cut both connections at the client's next request HEADERS frame
      (the call never reaches the daemon);
    - `cut_sent`: cut once the client's next request went out whole (its DATA frame with
      END_STREAM forwarded): the daemon gets the call, and its caller is gone while it
      runs it (the daemon can tell: it must release what the call made);
    - `cut_answers`: cut at the daemon's next response HEADERS frame (the daemon ran the
      call; its answer is lost);
    - `cut_after_data`: cut at the daemon's Nth next response DATA frame (a stream that
      breaks midway: a Load's progress);
    - `hold_answers_s`: hold each response HEADERS frame this long (a slow network: the
      caller's deadline passes while the daemon believes it answered);
    - `down`: new connections are accepted and closed at once, live ones cut (`go_down`);
    - `gate`: while set to an unset Event, requests wait for it (whole) before they go on.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.cut_requests = 0
        self.cut_sent = 0
        self.cut_answers = 0
        self.cut_after_data = 0
        self.hold_answers_s = 0.0
        self.down = False
        self.gate: threading.Event | None = None
        self.cuts = 0
        self._closed = False
        self._mu = threading.Lock()
        self._live: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def disarm(self) -> None:
        self.cut_requests = self.cut_sent = self.cut_answers = self.cut_after_data = 0
        self.hold_answers_s = 0.0
        self.down = False

    def go_down(self) -> None:
        self.down = True
        with self._mu:
            live = list(self._live)
        self._close(*live)

    def close(self) -> None:
        self._closed = True
        self.go_down()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # (wakes the accepting thread)
        self._listener.close()

    def _take(self, name: str) -> bool:
        with self._mu:
            left = getattr(self, name)
            if left <= 0:
                return False
            setattr(self, name, left - 1)
            self.cuts += 1
            return True

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down:
                self._close(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
                upstream.settimeout(None)
            except OSError:
                self._close(client)
                continue
            with self._mu:
                self._live.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
            with self._mu:
                self._live.discard(s)

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        """Forward frame by frame (9-byte HTTP/2 frame headers, after the client's preface
        on the request side), cutting both connections where a fault is armed."""
        buf = b""
        preface = len(_PREFACE) if requests else 0
        try:
            while data := src.recv(65536):
                buf += data
                out = b""
                if preface:
                    n = min(preface, len(buf))
                    out, buf, preface = buf[:n], buf[n:], preface - n
                while len(buf) >= 9 and not preface:
                    size = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + size:
                        break
                    kind, flags = buf[3], buf[4]
                    stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                    frame, buf = buf[: 9 + size], buf[9 + size :]
                    if stream and kind == _HEADERS and requests and self._take("cut_requests"):
                        raise _Cut(out)
                    if stream and requests and (gate := self.gate) is not None and not gate.is_set():
                        if out:
                            dst.sendall(out)
                            out = b""
                        gate.wait(10)
                    if (stream and kind == _DATA and flags & _END_STREAM and requests
                            and self._take("cut_sent")):
                        raise _Cut(out + frame)
                    if stream and kind == _HEADERS and not requests:
                        if self._take("cut_answers"):
                            raise _Cut(out)
                        if self.hold_answers_s:
                            if out:
                                dst.sendall(out)
                                out = b""
                            time.sleep(self.hold_answers_s)
                    if stream and kind == _DATA and not requests and self.cut_after_data:
                        with self._mu:
                            self.cut_after_data -= 1
                            cut = self.cut_after_data == 0
                            self.cuts += cut
                        if cut:
                            raise _Cut(out)
                    out += frame
                if out:
                    dst.sendall(out)
        except _Cut as cut:
            with contextlib.suppress(OSError):
                if cut.out:
                    dst.sendall(cut.out)
        except OSError:
            pass
        self._close(src, dst)


class _Cut(Exception):
    def __init__(self, out: bytes) -> None:
        super().__init__("cut")
        self.out = out
