"""``specd coordinator``: the public server as its own process (workers started separately).

Runs :class:`specd.coordinator.server.Coordinator` on a grpc.aio server until SIGTERM/SIGINT, then
drains (serving.md §4): health NOT_SERVING, ``server.stop(grace=drain_timeout_s)`` (in-flight streams
may finish, new calls get UNAVAILABLE, HTTP/2 GOAWAY), close the worker channels. In-flight requests
still running at the end of the grace period are cancelled, which releases their worker sequences.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

from .config import add_arguments as _add_config_arguments
from .config import config_from_args

log = logging.getLogger("specd.coordinator")


def add_arguments(p) -> None:
    _add_config_arguments(p)  # includes --drain-timeout-s (CoordinatorConfig.drain_timeout_s)


async def serve(cfg, drain_timeout_s: float | None = None, ready=None) -> None:
    from .server import Coordinator, start_server

    if drain_timeout_s is None:
        drain_timeout_s = cfg.drain_timeout_s
    coord = Coordinator(cfg)
    server, port = await start_server(coord)
    log.info("coordinator: listening on %s (target %s, drafter %s; feature transport %s; hot path: target %s, "
             "drafter %s)", cfg.listen, cfg.target, cfg.drafter or "-", cfg.feature_transport,
             coord.hot_path["target"], coord.hot_path["drafter"] or "-")
    print(f"READY {cfg.listen} port={port}", flush=True)
    if ready is not None:
        ready(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    await stop.wait()
    log.info("coordinator: draining (%.1f s)", drain_timeout_s)
    await server.health.enter_graceful_shutdown()
    await server.stop(grace=drain_timeout_s)
    await coord.close()  # waits (bounded by release_timeout_s) for the Releases of cancelled streams


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = config_from_args(args)
    try:
        asyncio.run(serve(cfg))
    except RuntimeError as exc:  # start-up errors (address taken, worker mismatch) name the cause
        print(f"specd coordinator: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
