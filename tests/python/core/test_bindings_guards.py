"""Guards at the boundary of the bindings (pyspec._C): tensors whose torch flags DLPack drops,
integer arguments, and instances whose C++ object was never constructed."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyspec import _C, linear, ops

NEG_BIT = "negative bit"


def _filters_args():
    n, v = 2, 8
    return dict(logits=torch.randn(n, v), temperature=torch.ones(n),
                top_k=torch.zeros(n, dtype=torch.int32), top_p=torch.ones(n), min_p=torch.zeros(n),
                probs=torch.empty(n, v))


# (binding, its arguments as a dict in call order, the tensor arguments it reads or writes)
CASES = [
    ("linear", lambda: _C.linear,
     lambda: dict(x=torch.randn(2, 8), w=torch.randn(4, 8), bias=torch.randn(4),
                  out=torch.empty(2, 4)),
     ["x", "w", "bias", "out"]),
    ("rms_norm", lambda: _C.rms_norm,
     lambda: dict(x=torch.randn(2, 8), w=torch.randn(8), eps=1e-5, out=torch.empty(2, 8)),
     ["x", "w", "out"]),
    ("rotary_qkv", lambda: _C.rotary_qkv,
     lambda: dict(qkv=torch.randn(2, 4 * 8), cos=torch.randn(2, 8), sin=torch.randn(2, 8),
                  q=torch.empty(2, 2, 8), k=torch.empty(2, 1, 8), v=torch.empty(2, 1, 8)),
     ["qkv", "cos", "sin", "q", "k", "v"]),
    ("materialize_kv", lambda: _C.materialize_kv,
     lambda: dict(scratch=torch.randn(4, 2, 8), pages=torch.zeros(2, 16, 2, 8),
                  src_rows=torch.tensor([1]), dst_slots=torch.tensor([3])),
     ["scratch", "pages", "src_rows", "dst_slots"]),
    ("apply_sampling_filters", lambda: _C.apply_sampling_filters, _filters_args,
     ["logits", "temperature", "top_p", "min_p", "probs"]),
]


@pytest.mark.parametrize("name, fn, make, tensors", CASES, ids=[c[0] for c in CASES])
def test_neg_bit_tensors_are_refused(name, fn, make, tensors):
    """torch's negative bit (torch._neg_view, the .imag of a conjugate view) is a lazy negation
    that DLPack does not carry: read through the data pointer, an input lost its sign and an
    output's values came back negated. Inputs and outputs with it get a ValueError naming them."""
    fn = fn()
    fn(*make().values())  # the plain arguments are fine
    for t in tensors:
        args = make()
        args[t] = torch._neg_view(args[t])
        assert args[t].is_neg()
        with pytest.raises(ValueError, match=f"'{t}' has torch's {NEG_BIT}"):
            fn(*args.values())


def test_neg_bit_int_tensors_are_refused():
    bm = _C.BlockManager(4, 4)
    with pytest.raises(ValueError, match=f"'prompt' has torch's {NEG_BIT}"):
        bm.add_request(1, torch._neg_view(torch.tensor([1, 2, 3])))
    assert bm.add_request(1, torch._neg_view(torch.tensor([1, 2, 3])).resolve_neg()) == 0
    assert bm.tokens(1) == [-1, -2, -3]
    bm.reserve(1, 1)
    with pytest.raises(ValueError, match=f"'out' has torch's {NEG_BIT}"):
        bm.slots_for(1, 0, 2, torch._neg_view(torch.zeros(2, dtype=torch.int64)))


def test_neg_bit_never_gives_a_silently_wrong_result():
    """The public wrappers with a neg-bit input: either the right answer or a ValueError, never
    the values of the un-negated data. The imaginary part of a conjugate view is such a tensor."""
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    xn = torch.complex(torch.randn(3, 8), x).conj().imag  # == -x, flagged, not stored negated
    assert xn.is_neg() and torch.equal(xn, -x)
    for call, want in ((lambda: linear.linear(xn, w), F.linear(-x, w)),
                       (lambda: ops.rms_norm(xn, w[0], 1e-5), ops.rms_norm(-x, w[0], 1e-5))):
        try:
            got = call()
        except ValueError as e:
            assert NEG_BIT in str(e)
        else:
            torch.testing.assert_close(got, want)
    out = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=f"'out' has torch's {NEG_BIT}"):
        linear.linear(x, w, out=torch._neg_view(out))
    assert not out.any()  # nothing written


def test_conj_bit_and_resolved_views():
    """The conjugate bit exists only on complex tensors, which are refused by dtype (naming the
    argument); resolving a neg view gives a plain tensor that is used as is."""
    z = torch.complex(torch.randn(2, 8), torch.randn(2, 8)).conj()
    assert z.is_conj()
    with pytest.raises(ValueError, match="'x' has an unsupported dtype"):
        _C.linear(z, torch.randn(4, 8), None, torch.empty(2, 4))
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    out = torch.empty(2, 4)
    _C.linear(torch._neg_view(x).resolve_neg(), w, None, out)
    torch.testing.assert_close(out, F.linear(-x, w))


# ---- integer arguments --------------------------------------------------------------------------


_STEP_RESULT_BAD = [
    (lambda r: r.add_prefill(1.0, 3), "'request_id' must be an int; got float"),
    (lambda r: r.add_prefill(1, 3.5), "'num_computed' must be an int; got float"),
    (lambda r: r.add_prefill(1, None), "'num_computed' must be an int; got NoneType"),
    (lambda r: r.add_decode(1.0, [1]), "'request_id' must be an int; got float"),
    (lambda r: r.add_decode(np.float32(1), [1]), "'request_id' must be an int; got float32"),
    (lambda r: r.add_decode(True, [1]), "'request_id' must be an int; got bool"),
    (lambda r: r.add_decode("1", [1]), "'request_id' must be an int; got str"),
    (lambda r: r.add_decode(2 ** 70, [1]), "'request_id' = 1180591620717411303424 does not fit"),
    (lambda r: r.add_decode(1, [1, 2.0]), r"'tokens'\[1\] must be an int; got float"),
    (lambda r: r.add_decode(1, [2 ** 40]), r"'tokens'\[0\] = 1099511627776 does not fit in int32"),
    (lambda r: r.add_decode(1, "12"), "'tokens' must be a list of ints or a 1-D int32/int64"),
    (lambda r: r.add_decode(1, torch.tensor([1.0])), "'tokens' has dtype float32"),
    (lambda r: r.add_decode(1, [1], 2.0), "'num_drafted' must be an int; got float"),
    (lambda r: r.add_decode(1, [1], 0, 1.0), "'num_accepted' must be an int or None; got float"),
    (lambda r: r.add_decode(1, [1], num_accepted=np.float64(0)),
     "'num_accepted' must be an int or None"),
    (lambda r: r.add_decode(1, [1], 0, 0, 1.5), "'num_nodes' must be an int or None; got float"),
]


@pytest.mark.parametrize("call, match", _STEP_RESULT_BAD,
                         ids=[str(i) for i in range(len(_STEP_RESULT_BAD))])
def test_step_result_names_a_bad_argument(call, match):
    """A float (or other non-int) where StepResult wants an int: a ValueError naming the argument
    and what it may be (was pybind11's signature dump, or 'Unable to cast' for num_accepted)."""
    r = _C.StepResult()
    with pytest.raises(ValueError, match=match):
        call(r)
    assert len(r) == 0


def test_step_result_takes_int_likes():
    r = _C.StepResult()
    r.add_prefill(np.int64(1), torch.tensor(3))
    r.add_decode(np.int32(2), np.array([4, 5]), torch.tensor(1), np.int64(1))
    r.add_decode(3, torch.tensor([6], dtype=torch.int32))
    r.add_decode(4, (7, 8), num_drafted=2)
    assert len(r) == 4


@pytest.mark.parametrize("kw, match", [
    (dict(request_id=1.0), "'request_id' must be an int; got float"),
    (dict(prompt=[1, 2.5]), r"'prompt'\[1\] must be an int; got float"),
    (dict(max_tokens=4.0), "'max_tokens' must be an int; got float"),
    (dict(stop_token_ids=[2.0]), r"'stop_token_ids'\[0\] must be an int; got float"),
    (dict(stop_token_ids=None), "'stop_token_ids' must be a list of ints"),
])
def test_scheduler_add_request_names_a_bad_argument(kw, match):
    s = _C.Scheduler(8, 4)
    args = dict(request_id=1, prompt=[1, 2])
    args.update(kw)
    rid, prompt = args.pop("request_id"), args.pop("prompt")
    with pytest.raises(ValueError, match=match):
        s.add_request(rid, prompt, **args)
    assert not s.has_request(1)
    s.add_request(np.int64(1), torch.tensor([1, 2]), max_tokens=np.int32(3), stop_token_ids=(5,))
    assert s.request(1).max_tokens == 3 and s.request(1).prompt == [1, 2]


# ---- instances made by __new__ without __init__ -------------------------------------------------

# Arguments for methods that take more than ints (by class and name); ints are 0 otherwise.
_ARGS = {
    ("BlockManager", "add_request"): "(1, [1, 2])",
    ("BlockManager", "commit"): "(1, [1])",
    ("BlockManager", "slots_for"): "(1, 0, 1, None)",
    ("Scheduler", "add_request"): "(1, [1, 2])",
    ("Scheduler", "update"): "(_C.StepResult(),)",
    ("Scheduler", "set_cost_model"): "(0.1, 0.1)",
    ("Scheduler", "observe_step_time"): "(1, 1, 0.1)",
    ("Scheduler", "observe_draft_time"): "(0, 0.1, 1)",
    ("Scheduler", "switch_reason"): "(0, 0.5)",
    ("LinearKernels", "kernel"): "('float32',)",
    ("LinearKernels", "max_fast_rows"): "('float32',)",
    ("LinearKernels", "dense_route"): "('float32', 1)",
    ("LinearKernels", "packed_route"): "(1, True)",
    ("LinearKernels", "packed_rows_limit"): "(True,)",
    ("StepResult", "add_prefill"): "(1, 2)",
    ("StepResult", "add_decode"): "(1, [1])",
    ("SuffixIndex", "longest_match"): "([1],)",
    ("SuffixIndex", "propose"): "([1], 4, 2)",
    ("CudaAttentionPlan", "uses_tensor_cores"): "('float32', 'float32')",
    ("DecoderStack", "run"): "(0, 0, 0, _C.AttentionPlan.__new__(_C.AttentionPlan), 0, 0, 0, 0)",
}

_SWEEP = textwrap.dedent(r'''
    import re, sys
    from pyspec import _C
    ARGS = ARGS_HERE

    def int_args(doc):
        m = re.match(r"\w+\((.*)\) ->", doc or "")
        n = m.group(1).count("SupportsInt | typing.SupportsIndex") if m else 0
        return "(" + "0, " * n + ")"

    for cname in sorted(dir(_C)):
        C = getattr(_C, cname)
        if not isinstance(C, type) or C.__module__ != "pyspec._C" or issubclass(C, BaseException):
            continue
        print("class", cname, flush=True)
        for k, v in vars(C).items():
            if (k.startswith("_") and k not in ("__len__", "__repr__", "__contains__")
                    or isinstance(v, staticmethod)):
                continue
            if isinstance(v, property):
                if v.fget.__doc__ and "(arg0: object)" in v.fget.__doc__:
                    continue  # a static attribute (NO_SPACE)
                exprs = ["o." + k] + (["setattr(o, %r, [0])" % k] if v.fset else [])
            elif k == "__len__":
                exprs = ["len(o)"]
            elif k == "__repr__":
                exprs = ["repr(o)"]
            elif k == "__contains__":
                exprs = ["0 in o"]
            else:
                exprs = ["o.%s%s" % (k, ARGS.get((cname, k)) or int_args(v.__doc__))]
            for e in exprs:
                print("call", cname, e, flush=True)
                o = C.__new__(C)
                try:
                    r = eval(e)
                except Exception as err:
                    if not (isinstance(err, TypeError) and "is not initialized" in str(err)):
                        print("BAD", cname, e, "->", type(err).__name__, err, flush=True)
                else:
                    print("BAD", cname, e, "returned", repr(r)[:60])
    # an uninitialized instance as an argument
    s = _C.Scheduler(8, 4)
    try:
        s.update(_C.StepResult.__new__(_C.StepResult))
        print("BAD update took an uninitialized StepResult")
    except TypeError as err:
        assert "is not initialized" in str(err), err
    print("done")
''').replace("ARGS_HERE", repr(_ARGS))


def test_uninitialized_instances_raise_instead_of_crashing():
    """Cls.__new__(Cls) skips __init__: pybind11 then ran methods on unconstructed storage
    (garbage values, or a segfault for most classes). Every method, property, len/repr and
    argument use of such an instance, for every bound class, raises TypeError. Run in a
    subprocess so a crash fails the test instead of killing pytest."""
    p = subprocess.run([sys.executable, "-c", _SWEEP], capture_output=True, text=True, timeout=300,
                       cwd="/")
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("call")][-1:]
    assert p.returncode == 0, f"exit {p.returncode} at {last}: {p.stderr[-800:]}"
    bad = [ln for ln in p.stdout.splitlines() if ln.startswith("BAD")]
    assert not bad, "\n".join(bad)
    classes = {ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("class")}
    assert {"AttentionPlan", "BlockManager", "LinearKernels", "Request", "ScheduleOutput",
            "Scheduler", "StepResult", "SuffixIndex", "TokenTree"} <= classes
    assert p.stdout.rstrip().endswith("done")


def test_init_after_new_and_subclasses_still_work():
    r = _C.StepResult.__new__(_C.StepResult)
    with pytest.raises(TypeError, match="StepResult object is not initialized"):
        len(r)
    r.__init__()
    r.add_prefill(1, 2)
    assert len(r) == 1

    class Tree(_C.TokenTree):
        def __init__(self):
            super().__init__([-1, 0, 0])

    assert Tree().num_nodes == 3
    s = _C.Scheduler.__new__(_C.Scheduler)
    s.__init__(8, 4)
    assert s.num_free_blocks == 8
