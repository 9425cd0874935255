"""Training files are read without unpickling code: a pickle whose __reduce__ would run code,
given as --data, as a resumed run's data.pt, as its feature cache or as its checkpoint, is refused
with a clear error and the code never runs. Corpora and checkpoints are plain tensors, lists and
dicts (torch.load(weights_only=True)); an older pickled corpus is refused with how to regenerate
or convert it."""

import builtins
import os
import pickle
import shutil

import pytest
import torch

from pyspec import cli
from pyspec.train import data as D
from pyspec.train import loop as L


class _Payload:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _malicious_files(tmp_path, marker):
    """The payload as torch.save writes it (zip), as a plain pickle, and hidden inside a
    corpus-shaped dict."""
    zipped = tmp_path / "zipped.pt"
    torch.save({"x": _Payload(marker)}, zipped)
    raw = tmp_path / "raw.pt"
    with open(raw, "wb") as f:
        pickle.dump(_Payload(marker), f, protocol=2)
    inside = tmp_path / "inside.pt"
    torch.save({"format": D.CORPUS_FORMAT, "version": D.CORPUS_VERSION,
                "tokens": torch.zeros(3, dtype=torch.int64),
                "offsets": torch.tensor([0, 3]), "num_prompt": torch.tensor([1]),
                "hidden": [_Payload(marker)]}, inside)
    return [zipped, raw, inside]


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "payload-ran"
    yield path
    assert not path.exists(), "unpickling ran the payload"


def test_the_payload_runs_when_unpickled(tmp_path):
    """The test's payload does run code when a file is unpickled (what the loaders must avoid)."""
    m = tmp_path / "ran"
    torch.load(_malicious_files(tmp_path, m)[0], weights_only=False)
    assert m.exists()


def test_load_sequences_refuses_pickles(tmp_path, marker):
    for path in _malicious_files(tmp_path, marker):
        with pytest.raises(ValueError, match=f"--data: '{path}' (holds pickled Python objects "
                                             r"\(it names exec\), which pyspec does not load|is "
                                             "not a corpus saved by train-draft)"):
            D.load_sequences(str(path))
        assert not marker.exists()


def test_resume_refuses_pickles(tmp_path, marker):
    head = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(head.parameters())
    for path in _malicious_files(tmp_path, marker):
        with pytest.raises(ValueError, match=f"{path}: (the checkpoint holds pickled Python "
                                             r"objects \(it names exec\)|not a readable training "
                                             r"checkpoint|not a training checkpoint).*delete it to "
                                             "train from the first epoch"):
            L.resume(str(path), "head", head, opt)
    # What save writes, resume reads (weights_only): the model, the optimizer state, the epoch.
    opt.zero_grad()
    head(torch.ones(1, 2)).sum().backward()
    opt.step()
    L.save(str(tmp_path / "ckpt.pt"), "head", head, opt, 3)
    again = torch.nn.Linear(2, 2)
    opt2 = torch.optim.AdamW(again.parameters())
    assert L.resume(str(tmp_path / "ckpt.pt"), "head", again, opt2, log=lambda *a: None) == 3
    assert torch.equal(again.weight, head.weight)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])


def test_corpus_round_trip_and_old_format(tmp_path, marker):
    seqs = [D.Sequence_([1, 2, 3, 4], torch.randn(3, 8).to(torch.bfloat16), 2),
            D.Sequence_([5, 6], None, None), D.Sequence_([7], torch.zeros(0, 8), 0)]
    path = str(tmp_path / "data.pt")
    D.save_sequences(seqs, path)
    back = D.load_sequences(path)
    assert [(s.tokens, s.num_prompt) for s in back] == [(s.tokens, s.num_prompt) for s in seqs]
    assert torch.equal(back[0].hidden, seqs[0].hidden) and back[1].hidden is None
    # A corpus an older pyspec pickled: refused, saying how to go on; converted only on request.
    old = str(tmp_path / "old.pt")
    torch.save(seqs, old)
    with pytest.raises(ValueError, match=r"it names pyspec\.train\.data\.Sequence_\).*generate the "
                                         r"corpus again.*D\.convert_pickled_corpus\('"):
        D.load_sequences(old)
    D.convert_pickled_corpus(old)
    assert [s.tokens for s in D.load_sequences(old)] == [s.tokens for s in seqs]
    # A torch file of plain values that is not a corpus.
    torch.save({"format": D.CORPUS_FORMAT, "version": 2, "tokens": torch.zeros(3),
                "offsets": torch.tensor([0, 3]), "num_prompt": torch.tensor([1]),
                "hidden": [None]}, path)
    with pytest.raises(ValueError, match="not a corpus saved by train-draft.*'tokens' is not a "
                                         "1-D int64 tensor"):
        D.load_sequences(path)


def _cli(tiny, out, *extra):
    return cli.main(["train-draft", "--target", tiny, "--out", str(out), "--epochs", "1",
                     "--draft-vocab", "80", "--intermediate-size", "32", *extra])


def test_train_draft_refuses_pickles_on_every_path(tiny, trained, tmp_path, capsys, marker):
    """--data, a resumed run's data.pt, its feature cache and its checkpoint."""
    evil = _malicious_files(tmp_path, marker)[0]
    corpus = os.path.join(trained, "data.pt")

    assert _cli(tiny, tmp_path / "a", "--data", str(evil)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyspec: error: --data: '{evil}' holds pickled Python objects (it "
                          "names exec)") and err.count("\n") == 1, err
    assert not (tmp_path / "a").exists()

    resumed = tmp_path / "b"
    resumed.mkdir()
    shutil.copy(evil, resumed / "data.pt")
    assert _cli(tiny, resumed) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyspec: error: --out (resuming): '{resumed / 'data.pt'}' holds pickled "
                          "Python objects") and f"delete {resumed / 'data.pt'} to generate the " \
        "corpus again" in err, err

    cache = tmp_path / "c"
    cache.mkdir()
    shutil.copy(evil, cache / "features-2.pt")
    assert _cli(tiny, cache, "--data", corpus, "--feature-layers", "2") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyspec: error: --out (the feature cache): '{cache / 'features-2.pt'}' "
                          "holds pickled Python objects") and "to compute the features again" in err

    ckpt = tmp_path / "d"
    ckpt.mkdir()
    shutil.copy(evil, ckpt / "checkpoint.pt")
    assert _cli(tiny, ckpt, "--data", corpus) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyspec: error: {ckpt / 'checkpoint.pt'}: the checkpoint holds pickled "
                          "Python objects (it names exec)") and "delete it to train from the " \
        "first epoch" in err, err
    assert not (ckpt / "drafter.json").exists()


def test_a_payload_from_a_module_torch_blocks_is_named(tmp_path, marker):
    """torch words the refusal of os / sys / posix globals differently ("unsupported GLOBAL
    posix.system whose module posix is blocked"): still a pickled object named, never torch's
    hint to load with weights_only=False."""
    from pyspec.models.loader import load_weights_only

    class SystemPayload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    path = tmp_path / "system.bin"
    torch.save({"fc.weight": SystemPayload()}, path)
    with pytest.raises(ValueError) as e:
        load_weights_only(str(path), lambda name: f"pickled object {name}",
                          lambda why: f"unreadable: {why}")
    assert str(e.value) in ("pickled object posix.system", "pickled object nt.system"), str(e.value)
