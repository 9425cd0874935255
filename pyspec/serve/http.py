"""The HTTP server under ``pyspec serve`` (uvicorn's h11 protocol) with the limits a long-running
server needs that uvicorn does not set by itself:

* a **header deadline**: a connection must deliver a request's complete headers within
  ``header_timeout`` seconds of opening (or of its previous response), however it drips them
  (uvicorn's keep-alive timer restarts on every byte received); past it the connection is closed;
* the **body deadline** is the app's (``ServeOptions.body_timeout``: a 408);
* a **drain deadline** on SIGTERM / SIGINT: the server stops accepting connections, ``/ready``
  turns 503 and new requests get a 503; requests still running after ``drain_timeout`` seconds
  end with a clear 503 from the engine loop, and the process exits a moment later whatever a
  client still holds open.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

__all__ = ["run_server", "make_protocol", "make_server", "check_server_settings"]

log = logging.getLogger("pyspec.serve")


def make_protocol(header_timeout: float):
    """uvicorn's h11 protocol with a header deadline of ``header_timeout`` seconds."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _header_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_deadline(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # headers incomplete: nothing to answer

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's headers

    return Protocol


def check_listen(host: str, port: int) -> None:
    """ValueError naming --host / --port when this process cannot listen there (an unknown host,
    a port in use or not allowed): found before the model loads, not after the server starts."""
    import socket

    try:  # "" (as for the server) is every interface
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host}: not an address this machine can listen on ({e})") \
            from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"--host {host} --port {port}: cannot listen there "
                             f"({e.strerror or e}; another server on the port?)") from None


def check_server_settings(*, header_timeout: float, keep_alive_timeout: float,
                          drain_timeout: float, ssl_keyfile: Optional[str],
                          ssl_certfile: Optional[str]) -> None:
    """The HTTP server's deadlines and TLS pair, checked (by ``pyspec serve`` before the model
    loads, and by :func:`make_server`); errors name the command-line flag."""
    import math
    import os

    for name, v in (("header_timeout", header_timeout), ("keep_alive_timeout", keep_alive_timeout),
                    ("drain_timeout", drain_timeout)):
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or not 0 < v < 1e6):
            raise ValueError(f"--{name.replace('_', '-')} must be a number of seconds > 0; "
                             f"got {v!r}")
    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
    for name, path in (("ssl_keyfile", ssl_keyfile), ("ssl_certfile", ssl_certfile)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')}: no such file {path!r}")


def make_server(app, *, host: str, port: int, header_timeout: float = 10.0,
                keep_alive_timeout: float = 5.0, drain_timeout: float = 30.0,
                ssl_keyfile: Optional[str] = None, ssl_certfile: Optional[str] = None,
                log_level: str = "warning", access_log: bool = False):
    """A uvicorn server for ``app`` (from :func:`pyspec.serve.app.create_app`) with the header
    and drain deadlines above; ``access_log``: one line per request (method, path, status) on
    the ``uvicorn.access`` logger at INFO."""
    import uvicorn

    check_server_settings(header_timeout=header_timeout, keep_alive_timeout=keep_alive_timeout,
                          drain_timeout=drain_timeout, ssl_keyfile=ssl_keyfile,
                          ssl_certfile=ssl_certfile)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            http=make_protocol(header_timeout),
                            timeout_keep_alive=keep_alive_timeout,
                            timeout_graceful_shutdown=max(1, int(drain_timeout) + 2),
                            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
    if access_log:  # its lines at INFO, whatever the server's own log level
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)

    class Server(uvicorn.Server):
        timer = None

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                app.state.draining = True
                loop_ = app.state.engine_loop
                log.warning("shutting down: draining for at most %gs", drain_timeout)
                self.timer = threading.Timer(drain_timeout, loop_.shut_down)
                self.timer.daemon = True
                self.timer.start()
            super().handle_exit(sig, frame)

    return Server(config)


def run_server(app, **kwargs) -> int:
    """Serve until SIGTERM / SIGINT (drained) or an engine failure that stays down (exit status
    3, for a supervisor to restart the process)."""
    server = make_server(app, **kwargs)
    failed = []

    def on_fatal(e):
        failed.append(e)
        log.error("the engine failed for good; exiting so the process can be replaced")
        server.should_exit = True

    app.state.engine_loop.on_fatal = on_fatal
    server.run()
    return 3 if failed else 0
