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


def _cmd_convert_gguf(args: argparse.Namespace) -> int:
    from pyspec.models.gguf_convert import convert_gguf

    out = convert_gguf(args.file, args.out_dir, progress=True)
    print(f"wrote {out}")
    return 0


DEFAULT_PROMPT = ("Rewrite this Python function with clearer variable names and a docstring, "
                  "keeping the logic identical:\n\n"
                  "def f(a, b):\n    r = []\n    for x in a:\n        if x in b:\n"
                  "            r.append(x)\n    return r\n")


def _cmd_generate(args: argparse.Namespace) -> int:
    from pyspec import generation

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1; got {args.max_tokens}")
    if not 1 <= args.gamma <= 32:
        raise ValueError(f"--gamma must be in [1, 32]; got {args.gamma}")
    loaded = generation.load(args.model, dtype=args.dtype)
    ids = generation.encode_prompt(loaded.tokenizer, args.prompt, chat=not args.no_chat)
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, min_p=args.min_p, seed=args.seed, gamma=args.gamma)
    print(f"model: {loaded.path} ({args.dtype}; loaded in {loaded.load_seconds:.1f}s)")
    print(f"prompt: {len(ids)} tokens; draft: {args.draft}; temperature {args.temperature}")
    print("-" * 72)
    if args.compare:  # warm up (kernels, allocator) so neither timed run pays first-call costs
        generation.run(loaded, ids, draft="none", **dict(params, max_tokens=4))
    spec = generation.run(loaded, ids, draft=args.draft,
                          on_text=lambda t: print(t, end="", flush=True), **params)
    print()
    print("-" * 72)

    def line(name, r):
        return (f"{name:<12} {len(r.tokens):4d} tokens in {r.seconds:6.2f}s = "
                f"{r.decode_tokens_per_second:7.1f} tok/s decode ({r.steps} target steps, "
                f"finish: {r.finish_reason})")

    print(line(args.draft if args.draft != "none" else "plain", spec))
    print(f"acceptance length: {spec.acceptance_length:.2f} tokens per target step "
          f"({spec.accepted}/{spec.drafted} draft tokens accepted)")
    if args.compare:
        plain = generation.run(loaded, ids, draft="none", **params)
        print(line("plain", plain))
        print(f"speedup: {plain.seconds / spec.seconds:.2f}x end to end, "
              f"{spec.decode_tokens_per_second / plain.decode_tokens_per_second:.2f}x decode "
              f"(same process, same prompt)")
        same = plain.tokens == spec.tokens
        note = "" if args.temperature == 0 else " (sampled: equal in distribution, not per token)"
        print(f"outputs identical: {same}{note}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyspec", description="Speculative-decoding inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the build and device configuration")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT,
                   help="the user message (default: a code-rewriting request)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default="ngram", choices=["ngram", "none"],
                   help="drafter: ngram (prompt lookup) or none (plain decoding)")
    p.add_argument("--gamma", type=int, default=5, help="max draft tokens per step")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding and print both speeds, the speedup and whether "
                        "the outputs are identical")
    p.set_defaults(func=_cmd_generate)
    p = sub.add_parser("smoke", help="greedy plain vs speculative generation on a tiny random model")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=6, help="draft chain length (0 = plain only)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_smoke)
    p = sub.add_parser("convert-gguf", help="convert a llama GGUF file into a safetensors folder")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("out_dir", help="output folder (must not exist, or be empty)")
    p.set_defaults(func=_cmd_convert_gguf)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ImportError, OSError) as e:  # bad input or setup: one clear line, exit 2
        print(f"pyspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
