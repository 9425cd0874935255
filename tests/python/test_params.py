"""Sampling parameters (pyspec.params): the command lines check them (check_sampling_options)
before any model loads."""

import json

from pyspec import cli


def test_sampling_options_are_checked_before_loading(tmp_path, capsys):
    """Bad sampling values fail naming the option before the model loads (here: none exists)."""
    missing = str(tmp_path / "no-such-model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    for opts, message in ((["--temperature", "nan"], "--temperature must be"),
                          (["--temperature", "-1"], "--temperature must be")):
        assert cli.main(["eval-draft", "--target", missing, "--prompts", str(prompts), "--out",
                         str(tmp_path / "rep")] + opts) == 2
        err = capsys.readouterr().err
        assert message in err and "no-such-model" not in err, err
    for opts, message in ((["--temperature", "-1"], "--temperature must be"),
                          (["--top-p", "0"], "--top-p must be"),
                          (["--min-p", "2"], "--min-p must be"),
                          (["--top-k", "-1"], "--top-k must be")):
        assert cli.main(["generate", "x", "--model", missing] + opts) == 2
        err = capsys.readouterr().err
        assert message in err and "no-such-model" not in err, err
