"""speculum's server as Ray Serve replicas: ``speculum serve --replicas N``.

Ray Serve's HTTP proxy listens on ``--host``/``--port`` and its router hands each request to one of
``N`` replicas (the less loaded of two picked at random). A replica is a whole speculum server: the
same OpenAI routes, access guard (API keys, Host check, body size), limits, queue and Prometheus
``/metrics``, built from the same arguments by :func:`speculum.server.launch.build_state`. Each one
runs one engine (``--engines`` to change it) on its share of the cores, and answers with an
``x-speculum-replica`` header naming itself. Ray Serve's own metrics count requests per replica
(``ray_serve_deployment_request_counter_total``, on the metrics port this prints).

On one machine this starts a private Ray instance. To spread replicas over several machines, start
Ray on each (``ray start --head`` on one, ``ray start --address HEAD:6379`` on the others) and add
``--ray-address auto`` on the head: the command is otherwise the same.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ..errors import SpeculumError

APP_NAME = "speculum"
REPLICA_HEADER = "x-speculum-replica"


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpeculumError("--replicas needs Ray Serve: pip install 'speculum[ray]'") from None
    return ray, serve


def replica_class():
    """The Ray Serve deployment class (made on demand: importing this module needs no Ray)."""
    _, serve = _ray()

    @serve.ingress()
    class SpeculumReplica:
        """One speculum server (its own model copy, engine and queue) inside a Ray Serve replica."""

        def __init__(self, args: argparse.Namespace, threads: int, guard, origins: tuple[str, ...]):
            from ..server.launch import build_state

            self.args, self.guard, self.origins = args, guard, origins
            self.state = build_state(args, engines=args.engines or 1, threads=threads)
            context = serve.get_replica_context()
            self.name = str(getattr(context.replica_id, "unique_id", context.replica_tag))

        def __serve_build_asgi_app__(self):
            from ..server.app import create_app

            app = create_app(self.state, self.guard, self.origins)
            name = self.name

            @app.middleware("http")
            async def _name_replica(request, call_next):
                response = await call_next(request)
                response.headers[REPLICA_HEADER] = name
                return response

            return app

        def __del__(self):
            state = getattr(self, "state", None)
            if state is not None:
                state.close()

    return SpeculumReplica


def build_app(args: argparse.Namespace, guard, origins: tuple[str, ...], cpus: float | None = None):
    """The bound Ray Serve application: ``args.replicas`` replicas of speculum's server, each given
    ``cpus`` CPUs of Ray's accounting (default: this machine's cores shared out; in a cluster pass
    each replica's share of a node) and one thread fewer for its kernels (at least one). ``guard``
    and ``origins`` are resolved here, on the driver (API keys from its environment included), and
    shipped to every replica."""
    _, serve = _ray()
    replicas = args.replicas or 1
    cpus = cpus if cpus is not None else (os.cpu_count() or 1) / replicas
    # as `speculum serve --engines 1`: one core left to the HTTP side (here also Ray's proxy), since
    # kernels on several threads stall whenever another process takes one of their cores
    threads = args.threads or max(1, int(cpus) - 1)
    # Ray's router queues what a replica does not take; let each take its batch and its queue, so that
    # speculum's own 429 (queue full) still applies per replica
    ongoing = (args.max_batch or 16) + args.max_queue
    deployment = serve.deployment(
        replica_class(), name="SpeculumServer", num_replicas=replicas, max_ongoing_requests=ongoing,
        ray_actor_options={"num_cpus": cpus, **({"num_gpus": 1} if args.device == "cuda" else {})},
        health_check_period_s=10, graceful_shutdown_timeout_s=30,
    )
    return deployment.bind(args, threads, guard, origins)


def serve_replicas(args: argparse.Namespace, guard, origins: tuple[str, ...], metrics_port: int | None = None) -> int:
    """``speculum serve --replicas N``: start (or join) Ray, deploy, serve until SIGINT/SIGTERM."""
    ray, serve = _ray()
    started_here = args.ray_address is None
    init = {"address": args.ray_address} if not started_here else {
        "num_cpus": os.cpu_count() or 1, "include_dashboard": False, "_node_ip_address": "127.0.0.1",
        "_metrics_export_port": metrics_port or (args.port + 1 if args.port < 65535 else args.port - 1),
    }
    ray.init(logging_level="warning", log_to_driver=False, **init)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        # in a cluster each replica claims the CPUs its kernels use (--threads, default 2: one for
        # them, one for its HTTP side); here the machine's cores are shared out
        cpus = None if started_here else float((args.threads or 1) + 1)
        serve.run(build_app(args, guard, origins, cpus), name=APP_NAME, route_prefix="/")
        print(f"speculum: serving {args.served_model_name or args.model!r} ({args.method}) as {args.replicas or 1} "
              f"Ray Serve replica{'s' if (args.replicas or 1) > 1 else ''} on http://{args.host}:{args.port}/v1"
              + (f"; Ray metrics on http://127.0.0.1:{init['_metrics_export_port']}/metrics" if started_here else ""),
              file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        try:
            serve.delete(APP_NAME)
            if started_here:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0

