"""Per-request generation parameters (:class:`SamplingParams`) and their validation.

The one place a request's parameters are checked: :class:`pyspec.LLM`, the engine, the server and
the command line all call :func:`validate_params` (or :func:`check_sampling_options`, which names
the command-line option), so a bad value gets the same ``ValueError`` naming the field and what
is allowed wherever it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Union

__all__ = ["SamplingParams", "as_params", "validate_params", "check_sampling_options",
           "sample_seed", "MAX_STOP_CHARS"]

_F32_MAX = 3.4028234663852886e38  # the largest finite float32
_F32_TINY = 1.1754943508222875e-38  # the smallest normal float32

# Stop strings are checked against the text after every token; a bound on their length bounds
# that work per token (and no real stop sequence comes near it).
MAX_STOP_CHARS = 1024


@dataclass
class SamplingParams:
    """Per-request generation parameters.

    ``temperature == 0`` is greedy; ``seed=None`` draws a random seed. ``stop`` (strings) and
    ``n`` are applied by :class:`pyspec.LLM` and the server (the engine works on token ids);
    ``stop_token_ids`` end a request at the engine. ``ignore_eos``: do not stop at the tokenizer's
    end-of-sequence tokens (``pyspec.LLM`` adds them to ``stop_token_ids`` otherwise).
    ``speculative=False`` decodes the request plainly (one token per step) through the same engine.
    ``learn_partition``: drafters that learn from served text (``learn=``) draft this request from,
    and teach it to, only that partition's text (the server sets it to the tenant), so what one
    tenant sent never shapes another's drafts; None is the shared partition.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Sequence[int] = ()
    n: int = 1
    ignore_eos: bool = False
    speculative: bool = True
    learn_partition: Optional[str] = None


_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


def is_int(x) -> bool:
    """An integer that is not a bool."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, Real) and not isinstance(x, bool)


def as_params(params: Union[None, SamplingParams, Mapping]) -> SamplingParams:
    """``params`` as a :class:`SamplingParams` (None: the defaults; a dict: its fields, unknown
    keys refused)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        unknown = set(params) - _PARAM_NAMES
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}; allowed: "
                             f"{sorted(_PARAM_NAMES)}")
        return SamplingParams(**params)
    raise ValueError(f"params must be a SamplingParams, a dict or None; got {type(params).__name__}")


def validate_params(p: SamplingParams, vocab: int) -> None:
    """ValueError naming the bad field and what is allowed (``vocab`` bounds stop_token_ids)."""
    if not is_int(p.max_tokens) or p.max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1; got {p.max_tokens!r}")
    # The sampling filters run in float32: a value must stay in range once converted (1e300 is
    # finite here but inf there; a top_p of 1e-300 would become 0).
    if not is_real(p.temperature) or not 0.0 <= p.temperature <= _F32_MAX:
        raise ValueError(f"temperature must be a number in [0, {_F32_MAX:.4g}] (0 = greedy); "
                         f"got {p.temperature!r}")
    if not is_int(p.top_k) or p.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off); got {p.top_k!r}")
    if not is_real(p.top_p) or not _F32_TINY <= p.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (at least {_F32_TINY:.4g}, the smallest "
                         f"normal float32); got {p.top_p!r}")
    if not is_real(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1]; got {p.min_p!r}")
    for name in ("ignore_eos", "speculative"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be a bool; got {getattr(p, name)!r}")
    if p.learn_partition is not None and (not isinstance(p.learn_partition, str) or
                                          len(p.learn_partition) > 256):
        raise ValueError(f"learn_partition must be None or a string of at most 256 characters; "
                         f"got {p.learn_partition!r:.80}")
    if p.seed is not None and (not is_int(p.seed) or not -(1 << 63) <= p.seed < (1 << 63)):
        raise ValueError(f"seed must be None or a 64-bit signed int; got {p.seed!r}")
    if not is_int(p.n) or not 1 <= p.n <= 64:
        raise ValueError(f"n must be an int in [1, 64]; got {p.n!r}")
    if isinstance(p.stop_token_ids, (str, bytes, Iterator)) or \
            not isinstance(p.stop_token_ids, Iterable) or \
            not all(is_int(t) for t in p.stop_token_ids):
        # An iterator is refused: checking it here would consume it, and the request would then
        # silently stop on nothing.
        raise ValueError(f"stop_token_ids must be a list of ints; got {p.stop_token_ids!r}")
    stop_ids = [int(t) for t in p.stop_token_ids]
    if any(not 0 <= t < vocab for t in stop_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {stop_ids}")
    stop = p.stop
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(f"stop must be a non-empty string or a list of them; got {stop!r}")
        if len(items) > 16:
            raise ValueError(f"stop allows at most 16 strings; got {len(items)}")
        for s in items:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters; "
                                 f"got one of {len(s)}")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"stop string {ascii(s)[:80]} is not valid Unicode text (a lone "
                                 "surrogate): generated text can never contain it") from None


def check_sampling_options(params: SamplingParams) -> None:
    """``validate_params`` for command-line values, before a model is loaded: the message names
    the option (the field's name with '-' for '_'). The vocabulary only bounds stop_token_ids,
    which the commands do not set."""
    try:
        validate_params(params, vocab=1)
    except ValueError as e:
        field, _, rest = str(e).partition(" ")
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from None


def sample_seed(seed: int, k: int) -> int:
    """The seed of sample ``k`` of a request seeded ``seed`` (``n`` > 1): ``seed + k``, wrapped
    into the signed 64-bit range, so the largest valid seed stays valid."""
    return (int(seed) + k + (1 << 63)) % (1 << 64) - (1 << 63)
