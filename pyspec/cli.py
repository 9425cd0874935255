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


def _cmd_smoke(args: argparse.Namespace) -> int:
    from pyspec import smoke

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1; got {args.max_tokens}")
    if not 0 <= args.gamma <= 64:
        raise ValueError(f"--gamma must be in [0, 64]; got {args.gamma}")
    r = smoke.main(max_new_tokens=args.max_tokens, gamma=args.gamma, seed=args.seed)
    print("pyspec smoke: tiny random-weight Llama-style model (vocab 111, 2 layers), greedy,")
    print("prompt-lookup drafting (chain of up to %d) verified with tree attention over paged KV" % args.gamma)
    print(f"prompt tokens:      {r['prompt']}")
    print(f"generated tokens:   {r['spec_tokens']}")
    print(f"identical to plain: {r['identical']}")
    print(f"acceptance length:  {r['acceptance_length']:.2f} tokens/step "
          f"(draft acceptance rate {r['draft_acceptance_rate']:.2f})")
    print(f"plain:       {r['plain_tok_per_s']:8.1f} tok/s ({r['plain_steps']} steps)")
    print(f"speculative: {r['spec_tok_per_s']:8.1f} tok/s ({r['spec_steps']} steps)")
    print(f"speedup:     {r['speedup']:.2f}x (same process, same prompt)")
    return 0 if r["identical"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyspec", description="Speculative-decoding inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the build and device configuration")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("smoke", help="greedy plain vs speculative generation on a tiny random model")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=6, help="draft chain length (0 = plain only)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_smoke)
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
