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
    "register": (
        "server.cluster.sidecar",
        "keep a worker that cannot register itself (vLLM, SGLang) in a cluster",
    ),
}


#: third-party modules of the ``worker`` extra; any other missing one is the ``server`` extra's
WORKER_EXTRA_MODULES = frozenset({"torch", "safetensors", "tokenizers", "jinja2"})


#: the extra a sub-command needs as a whole (``up`` runs torch workers by default; the worker
#: extra includes the server one)
COMMAND_EXTRAS = {"up": "worker", "orchestrator": "server", "worker": "server", "register": "server"}


def extra_for(exc: ModuleNotFoundError, command: str | None = None) -> str | None:
    """The extra that installs the missing module (at least ``command``'s), or None when it is
    none of our optional dependencies (a bug of ours, or a broken install: the traceback stays)."""
    top = (exc.name or "").partition(".")[0]
    if not top or top in ("fastcore", "server"):
        return None
    needs = {
        "worker" if top in WORKER_EXTRA_MODULES else "server",
        COMMAND_EXTRAS.get(command or "", "server"),
    }
    return "worker" if "worker" in needs else "server"


def missing_extra(exc: ModuleNotFoundError, command: str | None = None) -> str | None:
    """ "<module> is not installed; ... pip install ..." for a missing optional dependency (or None,
    as :func:`extra_for`)."""
    extra = extra_for(exc, command)
    if extra is None:
        return None
    top = (exc.name or "").partition(".")[0]
    return f"{top} is not installed; this needs the {extra} extra: pip install 'fastcore-serve[{extra}]'"


def version() -> str:
    import fastcore  # numpy only: importable from the bare wheel

    return f"fastcore-serve {fastcore.__version__} (fastcore backend: {fastcore.backend})"


def build_parser(unavailable: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command. One whose module needs a missing extra is still listed
    (its help says what to install) and its reason goes in ``unavailable``."""
    parser = argparse.ArgumentParser(
        prog="fastcore-serve",
        description="Disaggregated LLM serving with a zero-parse token-id relay.",
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_text) in COMMANDS.items():
        try:
            add_arguments = importlib.import_module(module).add_arguments
        except ModuleNotFoundError as exc:
            why, extra = missing_extra(exc, name), extra_for(exc, name)
            if why is None:
                raise
            sp = sub.add_parser(
                name, help=f"{help_text} [needs the {extra} extra]", description=f"{help_text}. {why}"
            )
            if unavailable is not None:
                unavailable[name] = why
            continue
        sp = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(sp)
    return parser


def cannot_listen(command: str, host: str, port: int, why: str, flag: str = "--port") -> str:
    """The one line a sub-command prints for a port it cannot use."""
    hint = "--host" if why.startswith(("the address", "the host")) else flag
    return f"fastcore-serve {command}: cannot listen on {host}:{port}: {why}; choose another with {hint}"


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
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "up")  # the default is a whole local deployment
    unavailable: dict[str, str] = {}
    parser = build_parser(unavailable)
    wants_help = any(a in ("-h", "--help") for a in argv[1:])
    if argv[0] in unavailable and not wants_help:  # before parsing: its flags are unknown here
        print(f"fastcore-serve {argv[0]}: {unavailable[argv[0]]}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    raise_open_file_limit()
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except ModuleNotFoundError as exc:  # imported on first use (torch, for a model)
        why = missing_extra(exc, args.command)
        if why is None:
            raise
        print(f"fastcore-serve {args.command}: {why}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
