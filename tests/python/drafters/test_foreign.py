"""vLLM's --speculative-config and SGLang's --speculative-* flags mapped onto pyspec's draft spec
(pyspec.drafters.foreign): every spelling gives the drafter it names, every option without an
equivalent is refused with the reason, and the CLI refuses them before a model loads."""

import argparse
import json

import pytest

from pyspec.drafters import EagleDrafter, MedusaDrafter, ModelDrafter, NgramDrafter, make_drafter
from pyspec.drafters.foreign import SpecSettings, add_flags, from_sglang, from_vllm, settings_from_args
from pyspec.runner import ModelRunner

from test_published import _eagle3_dir, _eagle_dir, _medusa_dir


@pytest.fixture
def folders(model, tmp_path):
    from drafters_support import _heads_dir

    eagle, _ = _eagle_dir(str(tmp_path / "eagle"), model)
    medusa, _ = _medusa_dir(str(tmp_path / "medusa"), model)
    own = _heads_dir(str(tmp_path), model, "eagle")
    fused = _heads_dir(str(tmp_path), model, "eagle-fused")
    e3, _, _ = _eagle3_dir(str(tmp_path / "e3"), model)
    dm = tmp_path / "dm"
    dm.mkdir()
    (dm / "config.json").write_text("{}")
    return {"eagle": eagle, "medusa": medusa, "own": own, "fused": fused, "dm": str(dm), "e3": e3}


def test_vllm_spellings(folders):
    assert from_vllm('{"method": "ngram"}') == SpecSettings("ngram:5@min=5")
    assert from_vllm({"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                      "num_speculative_tokens": 4}) == SpecSettings("ngram:4@min=2", 4)
    assert from_vllm({"method": "ngram", "prompt_lookup_max": 3}).draft == "ngram:3@min=3"
    assert from_vllm({"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                      "disable_by_batch_size": 8}) == SpecSettings("ngram:3", None, 8)
    assert from_vllm({"method": "eagle", "model": folders["eagle"],
                      "num_speculative_tokens": 5}).draft == folders["eagle"] + "@depth=5"
    assert from_vllm({"method": "eagle", "model": folders["own"]}).draft == folders["own"]
    assert from_vllm({"method": "eagle3", "model": folders["fused"]}).draft == folders["fused"]
    assert from_vllm({"method": "eagle3", "model": folders["e3"],
                      "num_speculative_tokens": 3}).draft == folders["e3"] + "@depth=3"
    assert from_vllm({"method": "medusa", "model": folders["medusa"],
                      "num_speculative_tokens": 6}) == SpecSettings(folders["medusa"], 6)
    assert from_vllm({"method": "draft_model", "model": folders["dm"],
                      "num_speculative_tokens": 7}) == SpecSettings(folders["dm"] + "@depth=7", 7)
    assert from_vllm({"method": "pyspec", "draft": "ngram|suffix"}).draft == "ngram|suffix"
    assert from_vllm({"method": "ngram", "draft_tensor_parallel_size": 1,
                      "acceptance_method": "rejection_sampler", "quantization": None,
                      "enforce_eager": None, "disable_logprobs": True}).draft


@pytest.mark.parametrize("config,match", [
    ("{", "not valid JSON"),
    ("[]", "must be a JSON object"),
    ({}, "needs \"method\""),
    ({"method": "mtp"}, "multi-token-prediction"),
    ({"method": "ngram", "model": "x"}, "takes no \"model\""),
    ({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "is above"),
    ({"method": "ngram", "prompt_lookup_max": 0}, r"prompt_lookup_max must be an int in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "speculative_token_tree": "[(0,)]"}, "dynamic trees"),
    ({"method": "ngram", "posterior_threshold": 0.09}, "lossy"),
    ({"method": "ngram", "draft_tensor_parallel_size": 2}, "supports only"),
    ({"method": "ngram", "acceptance_method": "typical_acceptance_sampler"}, "supports only"),
    ({"method": "ngram", "enforce_eager": 1}, "supports only"),
    ({"method": "ngram", "revision": "main"}, "never a hub"),
    ({"method": "ngram", "bogus": 1}, "unknown key 'bogus'"),
    ({"method": "eagle"}, "needs \"model\""),
    ({"method": "eagle", "model": "/no/such/dir"}, "is not a folder"),
    ({"method": "eagle", "model": "MEDUSA"}, "holds Medusa heads, not an EAGLE head"),
    ({"method": "eagle3", "model": "EAGLE"}, "holds an EAGLE head, not an EAGLE-3 head"),
    ({"method": "draft_model", "model": "EAGLE"}, "not a draft model"),
    ({"method": "eagle", "model": "EAGLE", "prompt_lookup_max": 3}, "applies to method"),
    ({"method": "pyspec"}, "needs \"draft\""),
])
def test_vllm_refusals(folders, config, match):
    if isinstance(config, dict) and config.get("model") in ("MEDUSA", "EAGLE"):
        config = dict(config, model=folders[config["model"].lower()])
    with pytest.raises(ValueError, match=match):
        from_vllm(config)


def test_sglang_spellings(folders):
    e = folders["eagle"]
    assert from_sglang("EAGLE", e, 5, 4, 16) == SpecSettings(f"{e}@width=4,depth=5,nodes=15")
    assert from_sglang("eagle", e).draft == e
    assert from_sglang("EAGLE3", folders["e3"], 4).draft == folders["e3"] + "@depth=4"
    assert from_sglang("EAGLE", folders["e3"]).draft == folders["e3"]
    assert from_sglang("EAGLE3", folders["fused"], 3, 1, 4).draft == \
        folders["fused"] + "@width=1,depth=3,nodes=3"
    assert from_sglang("STANDALONE", folders["dm"], 4, 2, 9) == \
        SpecSettings(folders["dm"] + "@tree=2,depth=4", 8)
    assert from_sglang("NGRAM", num_draft_tokens=6) == SpecSettings("ngram", 5)
    for args, match in [((None,), "--speculative-algorithm is needed"),
                        (("NEXTN", e), "NEXTN"),
                        (("LOOKAHEAD",), "not supported"),
                        (("EAGLE", None), "needs --speculative-draft-model-path"),
                        (("EAGLE3", e), "not an EAGLE-3 head"),
                        (("STANDALONE", e), "not a draft model"),
                        (("EAGLE", e, 3, 1, 9), "exceeds what a chain of 3 steps holds"),
                        (("EAGLE", e, 3, 99), "eagle-topk must be an int"),
                        (("EAGLE", e, None, None, None, 0.5), "lossy"),
                        (("EAGLE", e, None, None, None, None, None, "map.pt"), "token-map"),
                        (("NGRAM", e), "takes no --speculative-draft-model-path")]:
        with pytest.raises(ValueError, match=match):
            from_sglang(*args)


def test_mapped_specs_load(model, folders):
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    d = make_drafter(from_vllm({"method": "ngram", "prompt_lookup_max": 4,
                                "prompt_lookup_min": 2}).draft, runner)
    assert isinstance(d, NgramDrafter) and (d.max_ngram, d.min_ngram) == (4, 2)
    # min=2: a single repeated token is no match any more.
    assert d.draft_source([5, 1, 2, 9, 9]) is None and d.draft_source([1, 2, 7, 1, 2]) == 2
    e = make_drafter(from_sglang("EAGLE", folders["eagle"], 5, 4, 16).draft, runner)
    assert isinstance(e, EagleDrafter) and (e.width, e.max_depth, e.max_nodes) == (4, 5, 15)
    m = make_drafter(from_vllm({"method": "medusa", "model": folders["medusa"]}).draft, runner)
    assert isinstance(m, MedusaDrafter)
    with pytest.raises(ValueError, match="unknown ngram option 'max'"):
        make_drafter("ngram:3@max=2", runner)
    with pytest.raises(ValueError, match=r"min_ngram .M of ngram:N@min=M. must be an int in \[1, max_ngram=3\]"):
        make_drafter("ngram:3@min=4", runner)
    # A draft-model folder's depth option (what vLLM's num_speculative_tokens maps to).
    from pyspec.models.llama import LlamaForCausalLM

    dm = ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=1), runner, max_depth=7)
    assert dm.max_draft_depth == 7


def _args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--draft", default=None)
    add_flags(p)
    return p.parse_args(argv)


def test_flags(folders):
    assert settings_from_args(_args([])) is None
    s = settings_from_args(_args(["--speculative-config", json.dumps({"method": "ngram"})]))
    assert s.draft == "ngram:5@min=5"
    s = settings_from_args(_args(["--speculative-algorithm", "EAGLE",
                                  "--speculative-draft-model-path", folders["eagle"],
                                  "--speculative-num-steps", "2"]))
    assert s.draft == folders["eagle"] + "@depth=2"
    with pytest.raises(ValueError, match="not both"):
        settings_from_args(_args(["--draft", "ngram", "--speculative-config", "{}"]))
    with pytest.raises(ValueError, match="not both"):
        settings_from_args(_args(["--speculative-config", "{}", "--speculative-num-steps", "2"]))


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_refuses_before_loading(command, capsys):
    from pyspec.cli import main

    rc = main([command, "--model", "/no/such/model", "--speculative-config",
               '{"method": "ngram", "posterior_alpha": 0.3}'])
    err = capsys.readouterr().err
    assert rc == 2 and "posterior_alpha" in err and "lossy" in err
    assert "/no/such/model" not in err  # refused before the model was looked at
