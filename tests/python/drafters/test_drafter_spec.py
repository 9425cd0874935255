"""The draft-spec grammar (pyspec.drafters.spec, make_drafter): ``+`` and ``|`` combinations,
options on parts, folders whose names hold a separator, messages that name what is wrong, and
"default" on a target the shipped drafters do not fit."""

import os

import pytest

from pyspec.drafters import EagleDrafter, FirstDrafter, MergedDrafter, make_drafter
from pyspec.runner import ModelRunner

from drafters_support import _heads_dir


def test_merged_spec_errors(model, tmp_path):
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    heads = _heads_dir(str(tmp_path), model, "eagle")
    f = make_drafter(heads + "@width=2,depth=1,nodes=2|ngram", runner)  # options on a part
    assert isinstance(f, FirstDrafter) and isinstance(f.parts[0], EagleDrafter)
    assert f.parts[0].max_depth == 1 and f.parts[0].width == 2
    plus = os.path.join(str(tmp_path), "a+b")  # a folder whose name holds a separator
    os.rename(heads, plus)
    assert isinstance(make_drafter(plus, runner), EagleDrafter)
    assert isinstance(make_drafter(plus + "@depth=1|ngram", runner), FirstDrafter)
    with pytest.raises(ValueError, match="none"):
        make_drafter("ngram+none", runner)
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("ngram+bogus", runner)
    m = make_drafter("ngram:2+ngram", runner)
    assert m.name == "ngram+ngram" and m.max_draft_depth == 5 and not m.needs_hidden
    with pytest.raises(ValueError, match="none"):
        make_drafter("none|ngram", runner)
    f = make_drafter("ngram|ngram:2+ngram", runner)  # '|' binds looser than '+'
    assert isinstance(f, FirstDrafter) and f.name == "ngram|ngram+ngram"
    assert isinstance(f.parts[1], MergedDrafter)
    # Messages that name what is wrong.
    for spec, match in (("ngram|", "empty part"), ("+", "empty part"),
                        ("ngram++ngram", "empty part"),
                        (str(tmp_path / "no-such-folder"), "does not exist"),
                        ("./nope", "does not exist"),
                        (plus + "@width=abc", "width=N needs an integer"),
                        (plus + "@nodes", "'nodes' needs a value"),
                        (plus + "@nodes=", "'nodes' needs a value"),
                        ("default:3", "takes no argument"), ("default:foo", "takes no argument"),
                        (os.path.join(str(tmp_path), "file.txt"), "is a file")):
        if spec.endswith("file.txt"):
            open(spec, "w").close()
        with pytest.raises(ValueError, match=match):
            make_drafter(spec, runner)


def test_default_on_another_architecture_is_ngram(model):
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    assert make_drafter("default", runner).name == "ngram"
