"""``trt-sora`` command line: one subcommand per stage, a thin layer over the Python API.

Only argparse and the config package load at start-up, so ``trt-sora --help``
works without torch installed.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading

from trt_sora import __version__
from trt_sora.errors import TrtSoraError

#: Subcommand modules (``trt_sora.cli.<name>``), each with ``add_parser(subparsers)``.
COMMANDS = ("export", "calibrate", "quantize", "export_checkpoint", "build", "check", "engine", "info",
            "random_checkpoint", "ls", "generate", "batch", "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trt-sora",
        description="Turn video diffusion transformers into calibrated, verified TensorRT engines.",
    )
    parser.add_argument("--version", action="version", version=f"trt-sora {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"trt_sora.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"trt_sora.cli.{name}":
                continue
            raise
        mod.add_parser(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like SIGINT, so every staged folder is cleaned up."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:  # torchrun ... -m trt_sora -- generate --run ...: torchrun would take --run as its own
        argv = argv[1:]
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    old = None  # CLI only (a library never takes signals), and only where Python allows it
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return int(args.func(args) or 0)
    except TrtSoraError as exc:
        print(f"trt-sora {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated:
        print("terminated (SIGTERM); nothing half-written was left behind", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a file-system condition no stage turned into a typed error yet
        print(f"trt-sora {args.command}: error: {exc.strerror or exc}"
              f"{f': {exc.filename}' if exc.filename else ''}; check that path (space, permissions) and retry",
              file=sys.stderr)
        return 2
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
