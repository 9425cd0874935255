"""The ``pyspec`` command."""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    import pyspec
    from pyspec import _C

    print(f"pyspec {pyspec.__version__}")
    print(f"built with CUDA: {bool(_C.built_with_cuda)}")
    reason = _C.cuda_unavailable_reason()
    print(f"CUDA devices: {_C.cuda_device_count()}" + (f" ({reason})" if reason else ""))
    print(f"CPU op threads: {_C.num_threads()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyspec", description="Speculative-decoding inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the build and device configuration")
    p.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad user input: one clear line, exit code 2
        print(f"pyspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
