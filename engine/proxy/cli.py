"""``onepiece proxy``: serve the Proxy's HTTP intake until SIGINT/SIGTERM.

Needs ``ONEPIECE_PROXY_TOKEN`` (the callers' shared secret, engine.proxy.auth) and binds the loopback
address unless told otherwise (``--host`` / ``ONEPIECE_BIND_HOST``).
"""

from __future__ import annotations

import argparse

from engine import envs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None,
                   help="address to bind (default: ONEPIECE_BIND_HOST, itself 127.0.0.1 unless set)")
    p.add_argument("--port", type=int, default=None, help="port (default: ONEPIECE_PROXY_PORT; 0 picks a free one)")
    p.add_argument("--etcd-url", default=None, help="etcd client URL (default: ONEPIECE_ETCD_URL)")
    p.add_argument("--redis-url", default=None, help="Redis URL (default: ONEPIECE_REDIS_URL)")
    p.add_argument("--max-queue", type=int, default=None, help="accepted unfinished requests per workflow")
    p.add_argument("--deliver", default=None, help="ResultDeliver policy for the first stage")
    p.add_argument("--set", dest="workflow_set", default=None,
                   help="the Workflow Set this Proxy serves (default: ONEPIECE_WORKFLOW_SET or 'default')")
    p.add_argument("--advertise", default=None,
                   help="the URL clients reach this Proxy at, registered in etcd (default: http://HOST:PORT)")


async def serve(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import signal
    import socket

    from aiohttp import web

    from engine.coord import etcd_client
    from engine.coord.routes import RouteTable
    from engine.embedded import free_port
    from engine.proxy import deadlines
    from engine.proxy.app import make_app
    from engine.proxy.injector import Injector
    from engine.proxy.monitor import RequestMonitor
    from engine.store import JobStore

    etcd_url, redis_url = args.etcd_url or envs.ETCD_URL, args.redis_url or envs.REDIS_URL
    if not etcd_url or not redis_url:
        print("error: --etcd-url and --redis-url (or ONEPIECE_ETCD_URL / ONEPIECE_REDIS_URL) are required")
        return 2
    from engine.proxy.auth import check_token

    try:
        token = check_token(envs.PROXY_TOKEN)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    host = args.host or envs.BIND_HOST
    port = envs.PROXY_PORT if args.port is None else args.port
    port = port or free_port(host)
    from engine.store.objects import from_config

    # results read from the object store when one is configured, by their UID even after Redis lost the job
    store = JobStore.from_url(redis_url, ttl=envs.RESULT_TTL_S, objects=from_config(envs.OBJECT_STORE))
    workflow_set = args.workflow_set or envs.WORKFLOW_SET
    routes = RouteTable(etcd_client(etcd_url), envs.ROUTE_REFRESH_S, workflow_set=workflow_set).start()
    injector = Injector(routes, args.deliver or envs.DELIVER, envs.PROXY_SEND_TIMEOUT_S)
    url = args.advertise or f"http://{host}:{port}"
    app = make_app(store, routes, injector, RequestMonitor(args.max_queue or envs.PROXY_MAX_QUEUE),
                   registration=(workflow_set, f"{socket.gethostname()}-{os.getpid()}", url), token=token)
    runner = deadlines.runner(app)  # a request's head must arrive within ONEPIECE_HEADER_TIMEOUT_S
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        print(f"proxy: http://{host}:{port}", flush=True)  # (--advertise may name another URL)
        await stop.wait()
    finally:
        await runner.cleanup()
        injector.close()
        routes.stop()
        store.close()
    print("proxy stopped", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """Serve on uvloop: the Proxy's CPU per request is mostly the event loop's and the Redis client's own
    (with hiredis parsing replies), and uvloop with hiredis took about 10% of it off (benchmarks/e2e.md)."""
    import uvloop

    return uvloop.run(serve(args))
