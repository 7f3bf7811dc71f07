"""``python -m cmx.api``: the admin API standalone, in the foreground, with uvicorn.

It joins the Ray cluster at ``--address`` (default: ``auto``, the local one) and serves the
running service; it does not start the service. The token comes from CMX_ADMIN_TOKEN only, never
from the command line, where other users of the machine could read it.
"""

from __future__ import annotations

import argparse
import sys

from cmx.config import AdminConfig, ServiceConfig


def main(argv: list[str] | None = None) -> int:
    base = AdminConfig.from_env()
    parser = argparse.ArgumentParser(prog="python -m cmx.api", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default=base.host, help="bind address (default %(default)s)")
    parser.add_argument("--port", type=int, default=base.port, help="0: any free port")
    parser.add_argument("--address", default="auto", help="Ray cluster address")
    parser.add_argument("--token-all", action="store_true", default=base.token_all,
                        help="every endpoint needs the token (CMX_ADMIN_TOKEN), reads too")
    parser.add_argument("--open-queries", action="store_true", default=base.open_queries,
                        help="block and prefix-lookup queries answer without the token "
                             "(they tell whoever asks what is cached)")
    args = parser.parse_args(argv)

    import uvicorn

    from cmx.api.app import create_app
    from cmx.api.backend import ServiceBackend
    from cmx.api.ray_metrics import RayMetricsMirror
    from cmx.api.server import bind, url_of

    try:
        admin = base.replace(host=args.host, port=args.port, token_all=args.token_all,
                             open_queries=args.open_queries)
    except ValueError as exc:
        parser.error(str(exc))
    service = ServiceConfig.from_env()
    backend = ServiceBackend.connect(args.address, service)
    app = create_app(lambda: backend, admin, mirror=RayMetricsMirror())
    sock = bind(admin.host, admin.port)
    port = sock.getsockname()[1]
    mode = "no token: mutations and queries refused" if admin.token is None else (
        "token required for every endpoint" if admin.token_all else
        "token required to mutate" + ("" if admin.open_queries else " and to query"))
    print(f"cmx admin API on {url_of(admin.host, port)} ({mode})", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
