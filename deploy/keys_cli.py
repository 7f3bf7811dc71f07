"""``cmx keys add | list``: the OpenAI application's API key file (``deploy.apikeys``).

    cmx keys add alice --file /etc/cmx/api-keys     a new key of tenant alice, printed once
    CMX_API_KEY_FILE=/etc/cmx/api-keys cmx serve     the application then checks every key

Mounted by ``cmx.operate.cli``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

__all__ = ["app"]

app = typer.Typer(help="API keys of the OpenAI application (`cmx serve`).", no_args_is_help=True)
out = Console(log_path=False, highlight=False)
err = Console(stderr=True, log_path=False)

FileOpt = Annotated[Path, typer.Option(
    "--file", help="The key file (made with mode 0600 if missing); `cmx serve` reads the one "
                   "CMX_API_KEY_FILE names.", dir_okay=False)]


@app.command()
def add(
    tenant: Annotated[str, typer.Argument(help="The tenant the key belongs to.")],
    file: FileOpt,
) -> None:
    """Add a new key of TENANT; print it, once (the file keeps only its SHA-256)."""
    from cmx.deploy.apikeys import KeyFileError, add_key

    try:
        key = add_key(str(file), tenant)
    except (KeyFileError, OSError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(code=2) from exc
    out.print(key, soft_wrap=True)
    err.print(f"added a key of tenant {tenant} to {file}; the application reads the file when "
              "it starts: restart it to use the new key")


@app.command("list")
def list_tenants(file: FileOpt) -> None:
    """The file's tenants and how many keys each holds (the keys are not in the file)."""
    from collections import Counter

    from cmx.deploy.apikeys import KeyFile, KeyFileError

    try:
        keys = KeyFile.load(str(file))
    except KeyFileError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(code=2) from exc
    for tenant, count in sorted(Counter(keys.tenants.values()).items()):
        out.print(f"{tenant}  {count} key{'s' if count > 1 else ''}")
