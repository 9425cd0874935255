"""The training loop (pyspec.train.loop): a run is deterministic and resumes from its
checkpoint."""

import json
import os

import torch

from train_support import _train


def test_training_is_deterministic_and_resumable(tiny, trained, tmp_path):
    from safetensors.torch import load_file

    again = _train(tiny, str(tmp_path / "again"))
    x = load_file(os.path.join(trained, "drafter.safetensors"))
    y = load_file(os.path.join(again, "drafter.safetensors"))
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k
    # A second run in the same folder reuses the generated data and resumes after epoch 1.
    more = _train(tiny, again, epochs=2)
    conf = json.load(open(os.path.join(more, "drafter.json")))
    assert conf["manifest"]["recipe"]["epochs"] == 2
