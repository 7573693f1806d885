"""Loading a checkpoint never runs code from the file: a crafted payload is refused (and does not run) on every
path that loads one (DETR --pretrained and --resume, backbone pretraining --resume, the LM trainer's --resume);
official- and our own-layout checkpoints still load; processes exchange plain data through JSON, not pickle."""
import argparse
import json

import numpy as np
import pytest
import torch

from linear_mha.integrations import checkpoint_io
from linear_mha.integrations import distributed
from linear_mha.integrations.detr.checkpoint import load_checkpoint, load_pretrained, rng_state, set_rng_state


class Payload:
    """Unpickling this calls open(marker, 'w'): a stand-in for any code a crafted file could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def crafted(path, marker, **entries):
    torch.save({"model": {}, "payload": Payload(marker), **entries}, path)
    return path


def test_a_crafted_checkpoint_is_refused_by_every_detr_path_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = crafted(tmp_path / "detr-r50.pth", marker)
    for load in (lambda: load_checkpoint(path), lambda: load_pretrained(torch.nn.Linear(1, 1), path)):
        with pytest.raises(ValueError, match=r"was refused: loading it would need the class or function "
                                             r"(builtins|_?io)\.open.*nothing in it was run"):
            load()
    assert not marker.exists()


@pytest.mark.parametrize("flag", ["--pretrained", "--resume"])
def test_the_trainer_refuses_a_crafted_checkpoint(tmp_path, flag):
    from linear_mha.integrations.detr.train import main
    from test_detr_train import TINY
    marker = tmp_path / "ran"
    path = crafted(tmp_path / "evil.pth", marker)
    with pytest.raises(ValueError, match=f"{flag} .*evil.pth was refused"):
        main(TINY + ["--epochs", "1", "--max-iters", "1", "--output-dir", str(tmp_path / "run"), flag, str(path)])
    assert not marker.exists()


def test_backbone_pretraining_refuses_a_crafted_checkpoint(tmp_path):
    from linear_mha.integrations.detr.pretrain import main
    marker = tmp_path / "ran"
    crafted(tmp_path / "checkpoint.pth", marker)
    with pytest.raises(ValueError, match="was refused"):
        main(["--backbone", "tiny", "--iters", "1", "--output-dir", str(tmp_path), "--resume", "--num-workers", "0",
              "--no-progress", "--", "--synthetic-train", "8", "--synthetic-val", "2"])
    assert not marker.exists()


def test_the_lm_trainer_refuses_a_crafted_checkpoint(tmp_path):
    from linear_mha.tools import train_lm
    marker = tmp_path / "ran"
    crafted(tmp_path / "checkpoint.pt", marker)
    with pytest.raises(ValueError, match="--resume .*checkpoint.pt was refused"):
        train_lm.main(["--corpus-bytes", "60000", "--steps", "1", "--dim", "32", "--depth", "1", "--seq-len", "32",
                       "--batch-size", "2", "--out", str(tmp_path), "--resume", "--no-progress"])
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", None])
def test_empty_truncated_or_foreign_files_name_the_file_and_the_flag(tmp_path, content):
    path = tmp_path / "checkpoint.pth"
    if content is None:  # a real checkpoint cut in half
        torch.save({"model": {"w": torch.zeros(1000)}}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=r"--resume .*checkpoint.pth is not a readable checkpoint"):
        load_checkpoint(path)


def test_damaged_checkpoints_give_one_clear_error_without_the_unsafe_advice(tmp_path):
    """Random bytes, truncations and flipped bytes of a real checkpoint: the unpickler fails with IndexError,
    KeyError, RuntimeError, ... ; every one must become the flag's ValueError naming the file, and never repeat
    torch's advice to retry with weights_only=False (which runs the code of a file nobody should trust)."""
    import io
    import random
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(16)}, "epoch": 3}, buffer)
    good, rng, path = buffer.getvalue(), random.Random(0), tmp_path / "checkpoint.pth"
    for i in range(150):
        if i % 3 == 0:
            data = rng.randbytes(rng.randint(1, 2000))
        elif i % 3 == 1:
            data = good[:rng.randint(0, len(good) - 1)]
        else:
            damaged = bytearray(good)
            for _ in range(rng.randint(1, 10)):
                damaged[rng.randrange(len(damaged))] = rng.getrandbits(8)
            data = bytes(damaged)
        path.write_bytes(data)
        try:
            checkpoint_io.safe_load(path, "--resume")
        except ValueError as exc:
            assert "--resume" in str(exc) and str(path) in str(exc), (i, str(exc))
            assert "weights_only" not in str(exc), (i, str(exc))


def _detr_r50():
    from linear_mha.integrations.detr.config import parse_args
    from linear_mha.integrations.detr.detr import build_model
    return build_model(parse_args(["--coco-path", "unused", "--num-classes", "91"]))[0]


@pytest.mark.slow
@pytest.mark.parametrize("with_args", [False, True])
def test_a_file_laid_out_like_the_official_release_loads_strictly(tmp_path, with_args):
    """The release holds the model's state dict (and DETR's main.py saves its argparse Namespace as 'args')."""
    source = _detr_r50()
    entries = {"model": source.state_dict()}
    if with_args:
        entries["args"] = argparse.Namespace(lr=1e-4, backbone="resnet50", dilation=False, num_queries=100)
    torch.save(entries, tmp_path / "detr-r50.pth")
    target = _detr_r50()
    load_pretrained(target, tmp_path / "detr-r50.pth")
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_our_rng_state_is_plain_data_and_restores_every_generator(tmp_path):
    torch.manual_seed(3)
    np.random.seed(4)
    state = rng_state()
    torch.save({"model": {}, "rng": [state]}, tmp_path / "c.pth")
    loaded = load_checkpoint(tmp_path / "c.pth")["rng"][0]  # weights_only: plain values and tensors only
    expected = (np.random.rand(3), torch.rand(3))
    np.random.seed(0)
    torch.manual_seed(0)
    set_rng_state(loaded)
    np.testing.assert_array_equal(np.random.rand(3), expected[0])
    assert torch.equal(torch.rand(3), expected[1])


def test_an_old_checkpoint_is_refused_with_the_conversion_and_converts(tmp_path):
    old = tmp_path / "old.pth"
    torch.save({"model": {"w": torch.ones(2)}, "rng": [{"python": (3, tuple(range(625)), None),
                                                          "numpy": np.random.get_state(),
                                                          "torch": torch.get_rng_state()}]}, old)
    with pytest.raises(ValueError, match=r"numpy.*python -m linear_mha.integrations.checkpoint_io .*old.pth converted.pth "
                                         r"--trust"):
        load_checkpoint(old)
    with pytest.raises(SystemExit):  # never without --trust
        checkpoint_io.main([str(old), str(tmp_path / "new.pth")])
    checkpoint_io.main([str(old), str(tmp_path / "new.pth"), "--trust"])
    converted = load_checkpoint(tmp_path / "new.pth")
    assert torch.equal(converted["model"]["w"], torch.ones(2))
    set_rng_state(converted["rng"][0])


def test_values_sent_between_processes_survive_json_exactly():
    value = {"rng": rng_state(), 7: [{"bbox": [0.1, 2.0 / 3.0], "score": float("nan")}], "t": (1, None, True)}
    encoded = json.loads(json.dumps(distributed._encode(value)))
    decoded = distributed._decode(encoded)
    assert decoded["t"] == (1, None, True) and decoded[7][0]["bbox"] == [0.1, 2.0 / 3.0]
    assert torch.equal(decoded["rng"]["torch"], value["rng"]["torch"]) and decoded["rng"]["python"] == \
        value["rng"]["python"]
    with pytest.raises(TypeError, match="plain values and tensors only"):
        distributed._encode({"x": Payload("never")})


def test_resuming_with_options_that_change_the_model_is_refused_by_name(tmp_path):
    from linear_mha.integrations.detr.train import main
    from test_detr_train import TINY
    run = ["--epochs", "1", "--max-iters", "1", "--output-dir", str(tmp_path / "detr")]
    main(TINY + run)
    ckpt = str(tmp_path / "detr" / "checkpoint.pth")
    with pytest.raises(ValueError, match=r"written with --attention 'softmax'; this run has --attention 'kernel'"):
        main(TINY + run + ["--resume", ckpt, "--attention", "kernel", "--epochs", "2"])
    with pytest.raises(ValueError, match=r"--hidden-dim 32; this run has --hidden-dim 16"):
        main(TINY + run + ["--resume", ckpt, "--hidden-dim", "16", "--nheads", "4"])

    from linear_mha.tools import train_lm
    lm = ["--corpus-bytes", "60000", "--steps", "1", "--depth", "1", "--seq-len", "32", "--batch-size", "2",
          "--eval-every", "1", "--val-bytes", "256", "--test-bytes", "256", "--out", str(tmp_path / "lm"),
          "--no-progress"]
    train_lm.main(lm + ["--dim", "32"])
    with pytest.raises(ValueError, match=r"--dim 32; this run has --dim 16"):
        train_lm.main(lm + ["--dim", "16", "--heads", "4", "--resume", "--steps", "2"])
