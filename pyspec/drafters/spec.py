"""The draft-spec grammar, in one place: the strings that choose a drafter (``LLM(draft=...)``,
``--draft``, the server's config) turned into drafters for a target runner.

:func:`make_drafter` turns a spec into a drafter::

    "none"                 plain decoding (returns None)
    "ngram" | "ngram:N"    prompt lookup, n-grams up to N (default 3)
    "ngram:N@min=M"        ... of at least M tokens (default 1)
    "lookahead[@OPTIONS]"  lookahead decoding: Jacobi iteration and an n-gram pool of its own
                           trajectory, no weights (window=W, ngram=N, pool=P, nodes=M,
                           context=0|1; pyspec.drafters.lookahead)
    "layer-skip:L"         the target's first L layers + final norm + lm_head ("layer-skip": L/4)
    "default"              for the embedded model: prompt lookup, else the corpus drafter shipped
                           in pyspec/data/default_corpus ("ngram|suffix"; "ngram|eagle" in a
                           build without it); a target the shipped drafters do not fit gets
                           "ngram"; one of the same vocabulary but other weights a warning
    "suffix[@OPTIONS]"     the shipped corpus drafter alone (options as for PATH@... below)
    "eagle[@OPTIONS]"      the EAGLE head shipped in pyspec/data/default_drafter
    PATH                   a folder holding drafter.json (EAGLE/Medusa heads), published Medusa
                           (medusa_lm_head), EAGLE-1/2 or EAGLE-3 heads (pyspec.drafters.published), or
                           config.json (an independent draft model with the target's vocabulary)
    PATH@tree=W,depth=D    ... a draft model drafting top-W dynamic trees instead of a chain,
                           at most D levels deep (default 5)
    PATH@width=W,depth=D,nodes=N   ... an EAGLE drafter with another tree shape
    PATH@nodes=N,depth=D,match=M,min-match=K,prob=P,children=C,learn=T
                           ... a corpus drafter (drafter.json method "suffix": continuations
                           retrieved from the target's earlier answers) with other limits;
                           learn=T also learns from finished requests (their newest T tokens)
    A+B[+C...]             the drafters' trees merged into one per step (MergedDrafter), e.g.
                           "ngram+PATH"
    A|B[|C...]             per step, the draft of the first drafter that has one (FirstDrafter),
                           e.g. "ngram|PATH": prompt lookup, else the head ('|' binds looser than
                           '+': "ngram|A+B")
    a Drafter instance     used as is
"""

from __future__ import annotations

import os
from typing import Optional, Union

from pyspec.drafters.base import Drafter
from pyspec.drafters.folder import folder_kind, read_config, target_mismatch
from pyspec.drafters.heads import load_heads
from pyspec.drafters.merged import FirstDrafter, MergedDrafter
from pyspec.drafters.model import LayerSkipDrafter, ModelDrafter
from pyspec.drafters.ngram import NgramDrafter
from pyspec.drafters.published import load_published, published_kind
from pyspec.drafters.suffix import OPTIONS as SUFFIX_OPTIONS
from pyspec.drafters.suffix import load_suffix

__all__ = ["make_drafter", "split_spec", "is_draft_model_folder", "DRAFT_CHOICES"]

DRAFT_CHOICES = ("none, ngram, ngram:N, lookahead, layer-skip[:L], default, suffix, eagle, a "
                 "drafter/draft-model folder, or several joined by '+' (merged trees) or '|' "
                 "(the first that drafts)")


def make_drafter(spec: Union[None, str, Drafter], target_runner) -> Optional[Drafter]:
    if spec is None or spec == "none":
        return None
    if isinstance(spec, Drafter):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"draft must be a string ({DRAFT_CHOICES}) or a Drafter; got {spec!r}")
    split = split_spec(spec)
    if split is not None:
        sep, specs = split
        if any(not part for part in specs):
            raise ValueError(f"draft {spec!r} has an empty part: each part of 'A{sep}B' must be "
                             f"a drafter ({DRAFT_CHOICES})")
        parts = [make_drafter(part, target_runner) for part in specs]
        if any(p is None for p in parts):
            raise ValueError(f"{spec!r}: 'none' cannot be part of a combined drafter")
        return (FirstDrafter if sep == "|" else MergedDrafter)(parts)
    name, colon, arg = spec.partition(":")
    if name == "default":
        if colon:
            raise ValueError(f"draft {spec!r}: 'default' takes no argument (it is prompt lookup, "
                             "else the shipped corpus)")
        from pyspec.models.default import default_corpus_path, default_drafter_path

        # Prompt lookup when the context offers a continuation (long and often right), else the
        # continuations of the target's earlier answers (the shipped corpus: faster than prompt
        # lookup alone and than the shipped head, docs/performance.md); the head where a
        # build ships no corpus; prompt lookup alone for a target the shipped drafters do not fit.
        path = default_corpus_path()
        if path is not None and \
                read_config(path).get("vocab_size") == target_runner.model.cfg.vocab_size:
            return FirstDrafter([NgramDrafter(3), make_drafter(path, target_runner)])
        path = default_drafter_path()
        if path is None or target_mismatch(read_config(path), target_runner.model.cfg):
            return NgramDrafter(3)
        return FirstDrafter([NgramDrafter(3), make_drafter(path, target_runner)])
    shipped, at, opts = spec.partition("@")
    if shipped in ("eagle", "suffix"):
        from pyspec.models.default import shipped_drafter_path

        path = shipped_drafter_path(shipped)
        if path is None:
            raise ValueError(f"draft {shipped!r} names the drafter shipped for the embedded "
                             "model, and this build ships none; give a drafter folder")
        if shipped == "eagle":
            why = target_mismatch(read_config(path), target_runner.model.cfg)
            if why:
                raise ValueError(f"the shipped EAGLE head is for the embedded model: {why}")
        return make_drafter(path + at + opts, target_runner)
    base, _, opt = spec.partition("@")
    if base.partition(":")[0] == "ngram":
        over = _folder_options(opt, {"min": "min_ngram"}, "unknown ngram option", "")
        return NgramDrafter(_int_arg(base.partition(":")[2], "ngram", 3), **over)
    if base == "lookahead":
        from pyspec.drafters.lookahead import OPTIONS as LOOKAHEAD_OPTIONS, LookaheadDrafter

        return LookaheadDrafter(**_folder_options(opt, LOOKAHEAD_OPTIONS,
                                                  "unknown lookahead option", ""))
    if name == "layer-skip":
        total = target_runner.model.cfg.num_hidden_layers
        n = _int_arg(arg, "layer-skip", max(1, total // 4))
        if not 1 <= n < total:
            raise ValueError(f"layer-skip needs 1 <= L < {total} (the target's layers); got {n}")
        return LayerSkipDrafter(target_runner, n, max_depth=5)
    path, _, opt = spec.partition("@")
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        kind = published_kind(path)
        if kind is not None:  # Medusa / EAGLE heads as their authors publish them
            over = _folder_options(opt, {"width": "width", "depth": "max_depth",
                                         "nodes": "max_nodes"} if kind != "medusa" else {},
                                   f"unknown option for a {kind} head:", " (EAGLE trees)"
                                   if kind != "medusa" else " (none: a Medusa tree comes from its "
                                   "choice list)")
            return load_published(path, target_runner, **over)
        if folder_kind(path) == "drafter":
            cfg = read_config(path)
            if cfg["method"] == "suffix":
                over = _folder_options(opt, SUFFIX_OPTIONS, "unknown corpus drafter option", "")
                return load_suffix(path, cfg, target_runner, **over)
            over = _folder_options(opt, {"width": "width", "depth": "max_depth",
                                         "nodes": "max_nodes"},
                                   "unknown drafter option", " (EAGLE trees)")
            return load_heads(path, target_runner, **over)
        if folder_kind(path) == "draft-model":
            from pyspec.models.llama import LlamaForCausalLM

            over = _folder_options(opt, {"tree": "width", "depth": "max_depth"},
                                   "unknown draft-model option", " (tree=W: the tree width, 1 = "
                                   "a chain; depth=D: the deepest draft level)")
            tm = target_runner.model
            # As the target was loaded: its kernels, packed codes where exact unless the target
            # said "off".
            cross = _cross_tokenizers(path, tm)
            if cross is not None and "width" in over:
                raise ValueError(f"{path!r} has another tokenizer than the target's: its drafts "
                                 "are chains re-tokenized through text; tree= does not apply")
            model = LlamaForCausalLM.from_pretrained(
                path, dtype=tm.dtype, packed_weights=getattr(tm, "packed_weights", "auto"),
                kernels=getattr(tm, "kernels", None))
            if cross is not None:
                from pyspec.drafters.cross import CrossTokenizerDrafter

                return CrossTokenizerDrafter(model, *cross, target_vocab=tm.cfg.vocab_size,
                                             max_depth=over.get("max_depth", 5))
            return ModelDrafter(model, target_runner, same_tokenizer=_both_tokenizers(path, tm),
                                **{"width": 1, "max_depth": 5, **over})
        raise ValueError(f"{path!r} holds neither drafter.json (EAGLE/Medusa heads) nor "
                         "config.json (a draft model)")
    if os.path.exists(path):
        raise ValueError(f"{path!r} is a file, not a drafter folder (a folder with drafter.json "
                         "or a draft model's config.json)")
    if os.sep in path or path.startswith((".", "~")):
        raise ValueError(f"drafter folder {path!r} does not exist")
    raise ValueError(f"unknown drafter {spec!r}; use {DRAFT_CHOICES}")


def _both_tokenizers(path: str, target_model) -> bool:
    """The draft-model folder ``path`` and the folder the target was loaded from both hold a
    tokenizer.json."""
    source = getattr(target_model, "source_path", None)
    return os.path.isfile(os.path.join(path, "tokenizer.json")) and source is not None and \
        os.path.isfile(os.path.join(source, "tokenizer.json"))


def _cross_tokenizers(path: str, target_model):
    """(draft tokenizer, target tokenizer) when the draft-model folder ``path`` has a tokenizer
    other than the target's (drafts then go through text), else None (the same tokenizer, or the
    same vocabulary size without tokenizers: ids are shared). A draft model of another vocabulary
    size needs both tokenizers."""
    from pyspec.drafters.cross import same_vocabulary
    from pyspec.tokenizer import Tokenizer

    mine = os.path.isfile(os.path.join(path, "tokenizer.json"))
    source = getattr(target_model, "source_path", None)
    theirs = source is not None and os.path.isfile(os.path.join(source, "tokenizer.json"))
    from pyspec.models.config import ModelConfig

    vocab = ModelConfig.from_file(path).vocab_size
    if mine and theirs:
        dt, tt = Tokenizer.from_pretrained(path), Tokenizer.from_pretrained(source)
        dt.check_fits(vocab, path)
        return None if same_vocabulary(dt, tt) else (dt, tt)
    if vocab != target_model.cfg.vocab_size:
        raise ValueError(f"{path!r}: the draft model's vocabulary ({vocab} tokens) differs from the "
                         f"target's ({target_model.cfg.vocab_size}); drafting through text needs "
                         f"both tokenizers (tokenizer.json in the draft folder"
                         f"{'' if mine else ' (missing)'} and a target loaded from a folder with "
                         f"one{'' if theirs else ' (missing)'})")
    return None


def is_draft_model_folder(spec: str) -> bool:
    """``spec`` names a draft-model folder (a model with the target's vocabulary), as
    :func:`make_drafter` reads it."""
    path = os.path.expanduser(spec.partition("@")[0])
    return os.path.isdir(path) and folder_kind(path) == "draft-model"


def split_spec(spec: str):
    """``(separator, parts)`` of a combined spec (``A|B`` splits first: it binds looser than
    ``A+B``), or None for a single drafter. A folder whose name holds a separator is one part;
    options ("@...") may follow it."""
    path = spec.partition("@")[0]
    for sep in ("|", "+"):
        if sep in spec and not (sep in path and os.path.exists(os.path.expanduser(path))):
            return sep, spec.split(sep)
    return None


def _folder_options(opt: str, names: dict, unknown: str, what: str) -> dict:
    """``key=value,...`` options of a drafter folder spec, as keyword arguments (``names``: option
    -> argument; ``prob`` is a number, the rest integers)."""
    over = {}
    for item in filter(None, opt.split(",")):
        key, eq, val = item.partition("=")
        if key not in names:
            raise ValueError(f"{unknown} {key!r}; allowed: "
                             + ", ".join(f"{k}=" for k in names) + what)
        if not eq or not val:
            raise ValueError(f"drafter option {key!r} needs a value: {key}=VALUE")
        if key == "prob":
            try:
                over[names[key]] = float(val)
            except ValueError:
                raise ValueError(f"prob= needs a number in [0, 1); got {val!r}") from None
        else:
            over[names[key]] = _int_arg(val, key, 0, "=")
    return over


def _int_arg(arg: str, name: str, default: int, sep: str = ":") -> int:
    if not arg:
        return default
    try:
        return int(arg)
    except ValueError:
        raise ValueError(f"{name}{sep}N needs an integer N; got {arg!r}") from None
