"""``cmx up | status | lookup | block | evict | down``: the service from a shell (and ``keys``,
the OpenAI application's API key file, from ``cmx.deploy.keys_cli``).

Read commands take ``--json``. Commands after ``up`` find the admin API and its token in the
state file ``up`` wrote (``$CMX_STATE_DIR/state.json``, default ``~/.cache/cmx``); ``--url``
points them at another admin API (with CMX_ADMIN_TOKEN for its token).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

__all__ = ["app"]

app = typer.Typer()
out = Console(log_path=False)
err = Console(stderr=True, log_path=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
UrlOpt = Annotated[str | None, typer.Option(
    help="Admin API URL (default: the one `cmx up` recorded).", show_default=False)]


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[red]error:[/] {message}")
    return typer.Exit(code=code)


@contextmanager
def _steps() -> Iterator[Callable[[str], None]]:
    """A spinner per step on stderr; each new step completes the one before."""
    progress = Progress(SpinnerColumn(finished_text="[green]✓"), TextColumn("{task.description}"),
                        TimeElapsedColumn(), console=err, transient=False)
    current: list[Any] = []

    def step(description: str) -> None:
        if current:
            progress.update(current[-1], total=1, completed=1)
        current.append(progress.add_task(description, total=None))

    with progress:
        yield step
        if current:
            progress.update(current[-1], total=1, completed=1)


def _client(url: str | None) -> Any:
    from cmx.config import AdminConfig
    from cmx.operate.admin_client import AdminClient
    from cmx.operate.state import ServiceState

    admin = AdminConfig.from_env()
    state = ServiceState.load(admin.state_path)
    target = url or (state.admin_url if state else None)
    if target is None:
        raise _fail("no service recorded here: run `cmx up`, or pass --url")
    # The recorded token goes only to the API it belongs to.
    token = admin.token or (state.token if state and state.admin_url == target else None)
    return AdminClient(target, token)


def _call(fn: Callable[[], Any]) -> Any:
    from cmx.operate.admin_client import AdminApiError

    try:
        return fn()
    except AdminApiError as exc:
        raise _fail(str(exc), code=1) from exc


def _print_json(value: Any) -> None:
    out.print_json(json.dumps(value))


@app.command()
def up(
    address: Annotated[str | None, typer.Option(
        envvar="RAY_ADDRESS", show_default=False,
        help="Ray cluster (host:port or auto). Default: 127.0.0.1:RAY_PORT, started if no "
             "cluster answers there.")] = None,
    port: Annotated[int | None, typer.Option(
        help="Admin API port (default CMX_ADMIN_PORT or 8470; 0: any free port).",
        show_default=False)] = None,
    host: Annotated[str | None, typer.Option(
        help="Admin API bind address (default 127.0.0.1).", show_default=False)] = None,
    token_all: Annotated[bool, typer.Option(
        "--token-all", help="Every endpoint needs the token, reads too.")] = False,
    ray_port: Annotated[int, typer.Option(help="GCS port of a local head started here.")] = 6379,
    num_cpus: Annotated[int | None, typer.Option(
        help="CPUs of a local head (default: all).", show_default=False)] = None,
    dashboard: Annotated[bool, typer.Option(help="Ray's dashboard on a local head.")] = True,
    dashboard_port: Annotated[int, typer.Option(
        help="Its port (another free one if this is taken).")] = 8265,
    ray_arg: Annotated[list[str] | None, typer.Option(
        help="Extra argument for `ray start` (repeatable), e.g. --ray-arg=--object-store-memory"
             "=2000000000.", show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Start the service (and a local Ray head if none runs) and its admin API; print its URL."""
    from cmx.config import AdminConfig, ServiceConfig
    from cmx.errors import CmxError
    from cmx.operate.lifecycle import UpOptions
    from cmx.operate.lifecycle import up as start
    from cmx.operate.local_ray import HeadOptions

    try:
        base = AdminConfig.from_env()
        changes: dict[str, Any] = {"token_all": token_all or base.token_all}
        if port is not None:
            changes["port"] = port
        if host is not None:
            changes["host"] = host
        opts = UpOptions(
            address=address, admin=base.replace(**changes), service=ServiceConfig.from_env(),
            head=HeadOptions(port=ray_port, num_cpus=num_cpus, dashboard=dashboard,
                             dashboard_port=dashboard_port, extra_args=tuple(ray_arg or ())),
        )
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    try:
        with _steps() as step:
            result = start(opts, step)
    except CmxError as exc:
        raise _fail(str(exc), code=1) from exc
    s = result.state
    if json_out:
        _print_json({"admin_url": s.admin_url, "ray_address": s.ray_address,
                     "ray_dashboard": s.ray_dashboard,
                     "started_ray": s.started_ray, "already_up": result.already_up,
                     "state_file": opts.admin.state_path})
        return
    out.print(f"[bold green]CMX is {'already ' if result.already_up else ''}up[/]")
    out.print(f"  admin API and dashboard  [link={s.admin_url}]{s.admin_url}[/link]")
    out.print(f"  metrics                  {s.admin_url}/metrics")
    owner = "started by cmx up; `cmx down` stops it" if s.started_ray else "not started here"
    out.print(f"  Ray cluster              {s.ray_address} ({owner})")
    if s.ray_dashboard:
        out.print(f"  Ray dashboard            {s.ray_dashboard}")
    out.print(f"  state                    {opts.admin.state_path} (holds the admin token; "
              "mode 600)")


@app.command()
def status(url: UrlOpt = None, json_out: JsonOpt = False) -> None:
    """Nodes and tiers: occupancy, blocks, hit ratio, bandwidth, agent placement and queues."""
    from cmx.api.models import PoolStatus, TiersView
    from cmx.operate.render import status_tables

    client = _client(url)
    view = _call(lambda: client.get("/api/v1/tiers"))
    pool = _call(lambda: client.get("/api/v1/pool"))
    if json_out:
        _print_json({**view, "pool": pool, "admin_url": client.url})
        return
    for table in status_tables(TiersView.model_validate(view), PoolStatus.model_validate(pool)):
        out.print(table)
    out.print(f"[dim]{client.url} · dashboard at {client.url}/[/]")


def _read_tokens(values: list[int] | None, file: Path | None) -> list[int]:
    tokens = list(values or [])
    if file is not None:
        text = sys.stdin.read() if str(file) == "-" else file.read_text()
        text = text.strip()
        try:
            parsed = json.loads(text) if text.startswith("[") else [
                int(t) for t in text.replace(",", " ").split()]
        except ValueError as exc:
            raise _fail(f"{file}: token ids must be integers (JSON list or separated by "
                        f"spaces/commas): {exc}") from exc
        tokens += [int(t) for t in parsed]
    if not tokens:
        raise _fail("no token ids: give them as arguments or with --file")
    return tokens


@app.command()
def lookup(
    token_ids: Annotated[list[int] | None, typer.Argument(
        help="Token ids of the prompt.", show_default=False)] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", help="Read token ids from a file ('-': stdin), JSON or whitespace.",
        show_default=False)] = None,
    model: Annotated[str, typer.Option(help="Model id of the namespace.")] = "",
    num_layers: Annotated[int, typer.Option(min=1)] = 32,
    num_kv_heads: Annotated[int, typer.Option(min=1)] = 8,
    head_dim: Annotated[int, typer.Option(min=1)] = 128,
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    block_tokens: Annotated[int, typer.Option(min=1)] = 256,
    salt: Annotated[str, typer.Option(help="Tenant salt.")] = "",
    weights: Annotated[str, typer.Option(help="Weights fingerprint.")] = "",
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The longest cached prefix of a prompt in a namespace, and where its blocks are."""
    from cmx.operate.render import lookup_table

    if not model:
        raise _fail("--model is required (the namespace's model id)")
    tokens = _read_tokens(token_ids, file)
    client = _client(url)
    body = {"model": model, "salt": salt, "weights": weights, "token_ids": tokens,
            "layout": {"num_layers": num_layers, "num_kv_heads": num_kv_heads,
                       "head_dim": head_dim, "dtype": dtype, "block_tokens": block_tokens}}
    result = _call(lambda: client.post("/api/v1/lookup", body))
    if json_out:
        _print_json(result)
        return
    out.print(lookup_table(result))


@app.command()
def block(
    key: Annotated[str, typer.Argument(help="Block key, 64 hex digits.")],
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Where a block's copies are."""
    client = _client(url)
    result = _call(lambda: client.get(f"/api/v1/blocks/{key}"))
    if json_out:
        _print_json(result)
        return
    from cmx.operate.render import copies_table

    out.print(copies_table(result))


@app.command()
def evict(
    keys: Annotated[list[str], typer.Argument(help="Block keys, 64 hex digits each.")],
    tier: Annotated[str | None, typer.Option(
        help="Only this tier (hbm, dram, nvme).", show_default=False)] = None,
    node: Annotated[str | None, typer.Option(
        help="Only this node (id or unique prefix).", show_default=False)] = None,
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Evict blocks (pinned ones stay). Needs the admin token."""
    client = _client(url)
    body: dict[str, Any] = {"keys": keys}
    if tier:
        body["tier"] = tier
    if node:
        body["node"] = node
    result = _call(lambda: client.post("/api/v1/evict", body))
    if json_out:
        _print_json(result)
        return
    out.print(f"evicted {result['evicted']} cop{'y' if result['evicted'] == 1 else 'ies'} of "
              f"{result['requested']} key(s)")
    for r in result["results"]:
        if r["evicted"]:
            out.print(f"  {r['tier']:<5} on {r['node'][:12]}: {r['evicted']}")
    for name in result["unavailable"]:
        out.print(f"  [yellow]{name} did not answer[/]")


@app.command()
def orphans(
    collect: Annotated[bool, typer.Option(
        "--collect", help="Remove them (stores open anywhere are never removed).")] = False,
    older_than: Annotated[float, typer.Option(
        help="Only those unclaimed at least this many seconds.", min=0.0)] = 0.0,
    address: Annotated[str | None, typer.Option(
        help="Ray cluster (default: the one `cmx up` recorded).", show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Store directories no running node claims (left by nodes that are gone), per machine."""
    from cmx.config import AdminConfig
    from cmx.errors import CmxError
    from cmx.operate.lifecycle import orphans as run

    try:
        found = run(AdminConfig.from_env(), address, collect, older_than)
    except CmxError as exc:
        raise _fail(str(exc), code=1) from exc
    if json_out:
        _print_json({node: [{"name": o.name, "bytes": o.bytes, "age_s": o.age_s} for o in dirs]
                     for node, dirs in found.items()})
        return
    from cmx.operate.render import human_bytes

    verb = "removed" if collect else "unclaimed"
    rows = {o.name: o for dirs in found.values() for o in dirs}
    if not rows:
        out.print(f"no store directory {'removed' if collect else 'is unclaimed'}")
    for o in sorted(rows.values(), key=lambda o: -o.age_s):
        out.print(f"  {verb}  {o.name}  {human_bytes(o.bytes)}  {o.age_s / 3600:.1f} h")


@app.command()
def down(
    address: Annotated[str | None, typer.Option(
        help="Stop the service on this cluster even if `cmx up` did not record it.",
        show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Stop the admin API, the service's actors, and the Ray head if `cmx up` started it."""
    from cmx.config import AdminConfig
    from cmx.operate.lifecycle import down as stop

    admin = AdminConfig.from_env()
    with _steps() as step:
        result = stop(admin, address, step)
    if json_out:
        _print_json({"actors_stopped": result.actors_stopped, "ray_stopped": result.ray_stopped,
                     "had_state": result.had_state})
        return
    if not result.had_state and address is None:
        out.print("nothing recorded here: the service was not started with `cmx up`")
        return
    out.print(f"stopped {result.actors_stopped} actor(s)"
              + ("; the local Ray head is stopped" if result.ray_stopped else ""))


# keys: the API key file of the OpenAI application (`cmx serve`)
from cmx.deploy.keys_cli import app as _keys  # noqa: E402 - mounted after this module's commands

app.add_typer(_keys, name="keys")
