"""The ``pyspec serve`` command: one server (:mod:`pyspec.serve.cli` builds it) or, with
``--ray``, engine replicas on Ray Serve (:mod:`pyspec.serve.ray_app`)."""

from __future__ import annotations

import logging
import signal
import threading

from pyspec.serve import cli as serve_cli
from pyspec.serve.ray_app import check_ray_flags


def cmd_serve(args) -> int:
    from pyspec.serve.http import check_listen, run_server

    serve_cli.check_prompt_log(args)
    serve_cli.check_server_flags(args)
    check_ray_flags(args)
    if not args.ray:
        check_listen(args.host, args.port)
    logging.basicConfig(level=logging.INFO)
    if args.ray:
        from pyspec.serve.ray_app import run

        return run(args)
    lock = threading.RLock()  # SIGHUP and the watcher: one reload at a time
    served = {}

    def reload(*_):
        with lock:
            serve_cli.reload_config(served["app"], args.config)

    # The watcher's first look comes before the build reads the file: an edit made while the
    # model loads is applied once it has.
    watcher = (serve_cli.ConfigWatcher(args.config, args.watch_config, reload)
               if args.config and args.watch_config else None)
    print(f"loading {args.model or 'the embedded default model'} ...", flush=True)
    llm, app = serve_cli.build(args)
    served["app"] = app
    if args.config:
        signal.signal(signal.SIGHUP, reload)
    if watcher is not None:
        watcher.start()
    scheme = "https" if args.ssl_certfile else "http"
    print(f"serving {llm.model_path} as '{args.served_model_name}' with drafter "
          f"{llm.drafter_name} on {scheme}://{args.host}:{args.port}", flush=True)
    return run_server(app, host=args.host, port=args.port, header_timeout=args.header_timeout,
                      keep_alive_timeout=args.keep_alive_timeout,
                      drain_timeout=args.drain_timeout, ssl_keyfile=args.ssl_keyfile,
                      ssl_certfile=args.ssl_certfile, access_log=not args.no_access_log)


def add_parser(sub):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    serve_cli.add_serve_flags(p)
    p.set_defaults(func=cmd_serve)
    return p
