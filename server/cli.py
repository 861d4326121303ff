"""``fastcore-serve``: one entry point, a sub-command per process kind.

- ``fastcore-serve up``: a whole local deployment (default command);
- ``fastcore-serve orchestrator -c config.yaml``;
- ``fastcore-serve worker --role {both,context,generation} --model {tiny,synthetic,PATH}``.

Each sub-command's flags live beside its code (``add_arguments`` / ``run``)
so this file stays a dispatcher.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module with add_arguments(parser) and run(args) -> int, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("server.launcher", "start a local deployment: context + generation workers and an orchestrator"),
    "orchestrator": ("server.orchestrator.cli", "run the disaggregated-serving orchestrator"),
    "worker": ("server.worker.cli", "run a worker (torch model or synthetic)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastcore-serve",
        description="Disaggregated LLM serving with a zero-parse token-id relay.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sp)
    return parser


def raise_open_file_limit() -> tuple[int, int] | None:
    """Lift the soft RLIMIT_NOFILE to the hard limit (best effort); returns (soft, hard) or None.

    An orchestrator holding 1024 client streams keeps a connection to a
    worker for each leg too: a common default soft limit of 1024 descriptors
    would turn load into "Too many open files".
    """
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "up")  # the default is a whole local deployment
    args = build_parser().parse_args(argv)
    raise_open_file_limit()
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
