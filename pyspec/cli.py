"""The ``pyspec`` command."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from pyspec.cli_flags import DTYPES, add_model_flags


def _cmd_info(args: argparse.Namespace) -> int:
    import pyspec
    from pyspec import _C

    print(f"pyspec {pyspec.__version__}")
    print(f"built with CUDA: {bool(_C.built_with_cuda)}")
    reason = _C.cuda_unavailable_reason()
    print(f"CUDA devices: {_C.cuda_device_count()}" + (f" ({reason})" if reason else ""))
    print(f"CPU op threads: {_C.num_threads()}")
    k = _C.LinearKernels()
    print(f"dense layer kernels (a model's default, isa {k.isa}): " + ", ".join(
        f"{dt} {k.kernel(dt)} up to {k.max_fast_rows(dt)} rows"
        for dt in DTYPES) + ", torch's GEMM beyond")
    rows = k.packed_max_rows
    print("packed exact weights: " + (f"read as codes up to {rows} rows" if rows else
                                      "unavailable (needs the AVX2 or AVX-512 float32 kernel)"))
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
    import pyspec
    from pyspec.params import check_sampling_options

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1; got {args.max_tokens}")
    if not args.prompt.strip():
        raise ValueError("the prompt is empty; give the text to answer or continue (or leave it "
                         "out for the default prompt)")
    if args.gamma is not None and not 1 <= args.gamma <= 255:
        raise ValueError(f"--gamma must be in [1, 255]; got {args.gamma}")
    from pyspec.drafters.foreign import settings_from_args

    foreign = settings_from_args(args)  # vLLM / SGLang spellings, checked before the model loads
    fields = foreign.spec_config_fields() if foreign else {}
    if args.gamma is not None and "num_speculative_tokens" in fields:
        raise ValueError("give the draft length once: --gamma or the speculative config's "
                         "token count")
    if args.gamma is not None:
        fields["num_speculative_tokens"] = args.gamma
    draft = foreign.draft if foreign else (args.draft or "default")
    spec = pyspec.SpecConfig(adaptive=not args.no_adaptive, **fields)
    params = pyspec.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                   top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                   seed=args.seed, ignore_eos=args.ignore_eos)
    check_sampling_options(params)  # before the model loads (seconds to minutes)
    llm = pyspec.LLM(args.model, draft, spec, dtype=args.dtype, device=args.device,
                     packed_weights=args.packed_weights,
                     kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                     tensor_parallel_size=args.tensor_parallel_size,
                     attention_backend=args.attention_backend,
                     cuda_graphs=getattr(args, "cuda_graphs", False))
    prompt = ([{"role": "user", "content": args.prompt}]
              if not args.no_chat and llm.tokenizer.chat_template else args.prompt)
    ids = llm.chat_prompt(prompt) if isinstance(prompt, list) else llm.encode(prompt)
    packed = llm.model.packed_bytes
    weights = f", weights read as {packed / 1e6:.0f} MB of exact block codes" if packed else ""
    print(f"model: {llm.model_path} ({args.dtype} on {args.device}{weights}; loaded in "
          f"{llm.load_seconds:.1f}s)")
    print(f"drafter: {llm.drafter_name}")
    print(f"prompt: {len(ids)} tokens; temperature {args.temperature}")
    print("-" * 72)
    if args.compare:  # warm up (kernels, allocator) so neither timed run pays first-call costs
        llm.generate(ids, [dataclasses.replace(params, max_tokens=8)])
        llm.generate(ids, [dataclasses.replace(params, max_tokens=8, speculative=False)])
    t0 = time.perf_counter()
    first = None
    tokens = []
    stats = None
    reason = None
    for chunk in llm.stream(ids, params):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
        tokens.extend(chunk.token_ids)
        print(chunk.text, end="", flush=True)
        if chunk.finished:
            stats, reason = chunk.stats, chunk.finish_reason
    spec_s = time.perf_counter() - t0
    print()
    print("-" * 72)

    def rate(n, secs, ttft):
        """Decode speed: the tokens after the first over the time after it; None without any
        (one token is all prefill), rather than a NaN printed as a speed."""
        d = secs - (ttft or 0.0)
        return (n - 1) / d if n > 1 and d > 0 else None

    def speed(r):
        return f"{r:7.1f} tok/s decode" if r is not None else \
            "    n/a tok/s decode (no decode steps after the first token)"

    name = "speculative" if llm.engine.default_drafter else "plain"
    spec_rate = rate(len(tokens), spec_s, first)
    print(f"{name:<12} {len(tokens):4d} tokens in {spec_s:6.2f}s = {speed(spec_rate)} "
          f"({stats.steps} target steps, finish: {reason})")
    print(f"acceptance length: {stats.acceptance_length:.2f} tokens per speculative step "
          f"({stats.accepted_tokens}/{stats.draft_tokens} draft tokens accepted in "
          f"{stats.drafts} steps; {len(tokens) / max(stats.steps, 1):.2f} tokens per target step)")
    if stats.fallbacks or stats.switches:
        print(f"adaptive decisions: fallbacks {stats.fallbacks}, probes {stats.probes}, "
              f"switches {stats.switches}")
    if args.compare:
        plain = llm.generate(ids, [dataclasses.replace(params, speculative=False)])[0]
        p_rate = rate(len(plain.token_ids), plain.seconds, plain.time_to_first_token)
        print(f"{'plain':<12} {len(plain.token_ids):4d} tokens in {plain.seconds:6.2f}s = "
              f"{speed(p_rate)} ({plain.stats.steps} target steps, finish: "
              f"{plain.finish_reason})")
        decode = ("decode n/a (a run generated one token: no decode steps to compare)"
                  if spec_rate is None or p_rate is None else f"{spec_rate / p_rate:.2f}x decode")
        print(f"speedup: {plain.seconds / spec_s:.2f}x end to end, {decode} (same process, same "
              "prompt)")
        same = plain.token_ids == tokens
        # Deterministic drafts are verified by sampling the target with plain decoding's draws;
        # a draft model's sampled chains by rejection sampling (equal only in distribution).
        note = "" if args.temperature == 0 or same else (
            " (sampled drafts are verified by rejection sampling: equal in distribution, not per "
            "token)")
        print(f"outputs identical: {same}{note}")
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (`pyspec: error: ...`, exit status 2), like every other bad
    input, instead of the whole usage block first. Subcommands' parsers are this class too."""

    def error(self, message):
        self.exit(2, f"pyspec: error: {message} (`{self.prog} --help` lists the options)\n")


# The package extra that brings each optional module a command may import.
_EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "yaml": "serve",
           "opentelemetry": "serve", "ray": "ray", "triton": "triton"}


def build_parser() -> argparse.ArgumentParser:
    import pyspec

    parser = _Parser(prog="pyspec", description="Speculative-decoding inference.")
    parser.add_argument("--version", action="version", version=f"pyspec {pyspec.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the build and device configuration")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT,
                   help="the user message (default: a code-rewriting request)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None,
                   help="drafter: default (the shipped drafter, else ngram), ngram[:N], suffix, "
                        "eagle, lookahead, none, layer-skip[:L], a drafter / draft-model folder, "
                        "A|B or A+B; grammar in docs/drafters.md (default: default)")
    p.add_argument("--gamma", type=int, default=None,
                   help="most draft tokens per step (default: the drafter's)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="fixed draft length, no fallback to plain decoding")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the most likely tokens up to this probability mass "
                        "(default: 1 = off)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the K most likely tokens (default: 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this share of the top token's probability "
                        "(default: 0 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    add_model_flags(p, tensor_parallel=True)
    p.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding and print both speeds, the speedup and whether "
                        "the outputs are identical")
    from pyspec.drafters.foreign import add_flags as add_foreign_flags

    add_foreign_flags(p)
    p.set_defaults(func=_cmd_generate)
    p = sub.add_parser("smoke", help="greedy plain vs speculative generation on a tiny random model")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=6, help="draft chain length (0 = plain only)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_smoke)
    from pyspec.train.cli import add_parser as add_train
    from pyspec.train.cli import add_synth_parser
    from pyspec.train.evaluate import add_parser as add_eval

    from pyspec.serve.command import add_parser as add_serve

    add_train(sub)
    add_synth_parser(sub)
    add_eval(sub)
    add_serve(sub)
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
        extra = _EXTRAS.get((getattr(e, "name", None) or "").split(".")[0])
        hint = (f"; `pyspec {args.command}` needs pyspec's optional '{extra}' packages: pip "
                f"install 'pyspec-decode[{extra}]' (from a checkout: pip install '.[{extra}]')"
                if isinstance(e, ModuleNotFoundError) and extra else "")
        print(f"pyspec: error: {e}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (resumable commands say so)
        print(f"pyspec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
