"""train-draft --method medusa (pyspec.train.medusa): the heads learn, load as a drafter and
stay lossless."""

import json
import os

from pyspec import cli
from pyspec.train.data import load_sequences

from train_support import _lossless


def test_train_medusa_method(tiny, trained, tmp_path):
    """Medusa heads trained on a corpus learn (loss falls), load as a drafter, stay lossless."""
    from pyspec.train import medusa as M

    out = str(tmp_path / "medusa")
    rc = cli.main(["train-draft", "--target", tiny, "--out", out, "--method", "medusa",
                   "--data", os.path.join(trained, "data.pt"), "--medusa-heads", "3",
                   "--epochs", "3", "--lr", "3e-3", "--draft-vocab", "80"])
    assert rc == 0
    conf = json.load(open(os.path.join(out, "drafter.json")))
    assert conf["method"] == "medusa" and conf["medusa"]["num_heads"] == 3
    assert conf["manifest"]["recipe"]["medusa_heads"] == 3
    command = conf["manifest"]["recipe"]["command"]
    assert "--medusa-heads 3" in command and "--draft-vocab 80" in command
    assert "--batch-tokens 2048" in command and conf["manifest"]["recipe"]["batch_tokens"] == 2048
    assert "--unroll-steps" not in command and "--tree-nodes" not in command
    assert all(len(p) <= 3 for p in conf["medusa"]["tree"])
    llm, ref = _lossless(tiny, out, ("the cat sat on the mat", "abc abc abc abc"))
    assert "medusa" in llm.drafter_name
    # Training lowers the distillation loss of every head (heads start as the target's own head).
    import torch

    seqs = load_sequences(os.path.join(trained, "data.pt"))
    vocab = torch.arange(ref.model.cfg.vocab_size)
    fresh = M.MedusaHeads(ref.model, 3, vocab)
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["heads"]
    learned = M.MedusaHeads(ref.model, 3, vocab)
    learned.load_state_dict(state)
    feats, tgts = M._rows(seqs, list(range(len(seqs))), 3, 512)

    def loss(h):
        with torch.no_grad():
            t = torch.softmax(h.teacher(tgts), -1)
            return float(-(t * torch.log_softmax(h(feats), -1)).sum(-1).mean())

    assert loss(learned) < loss(fresh) - 1e-3
