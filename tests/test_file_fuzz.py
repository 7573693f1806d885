"""Files a user hands us, damaged in seeded ways: annotation files, images, run logs, --enwik8 and a results.json
to resume from. Each either works as it should or fails with one clear error naming the file; none ends in a raw
KeyError or TypeError from deep inside, a NaN, or a changed file on disk."""
import argparse
import copy
import hashlib
import json
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

from linear_mha.integrations.checkpoint_io import write_text_atomic
from linear_mha.integrations.detr.datasets import CocoDetection
from linear_mha.integrations.detr.plots import read_log, truncate_log
from linear_mha.integrations.detr.synthetic import make_synthetic_coco
from linear_mha.tools.calibrate_bench import previous_records
from linear_mha.tools.train_lm import load_splits

WRONG_VALUES = [None, "x", "", -1, 0, 1.5, True, [], {}, [1, 2], float("nan"), float("inf"), 10 ** 12]


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    paths = make_synthetic_coco(tmp_path_factory.mktemp("fuzz"), num_train=3, num_val=1, min_size=16, max_size=24)
    return Path(paths["train"]["images"]), Path(paths["train"]["annotations"])


def _digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _load_all(images, ann):
    """Every item of the set, as training reads them."""
    dataset = CocoDetection(images, ann)
    items = [dataset[i] for i in range(len(dataset))]
    dataset.image_sizes()
    return items


def _json_paths(node, prefix=()):
    """Every (path to a value) in a JSON tree."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield prefix + (key,)
        yield from _json_paths(child, prefix + (key,))


def _mutate(data, rng):
    """One structural change: a value deleted or replaced by one of another kind."""
    data = copy.deepcopy(data)
    path = rng.choice(list(_json_paths(data)))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.3:
        del parent[path[-1]]
        return data, f"deleted {path}"
    value = rng.choice(WRONG_VALUES)
    parent[path[-1]] = value
    return data, f"{path} = {value!r}"


def _assert_names(message, *files, what=""):
    message = str(message)
    assert any(str(f) in message for f in files), f"{what}: the error does not name the file: {message}"


def test_a_damaged_annotation_file_loads_right_or_fails_naming_it(coco, tmp_path):
    images, original = coco
    data = json.loads(original.read_text())
    rng, refused = random.Random(0), 0
    for n in range(300):
        damaged, what = _mutate(data, rng)
        ann = tmp_path / f"ann{n}.json"
        ann.write_text(json.dumps(damaged))
        before = _digest(ann)
        try:
            items = _load_all(images, ann)
        except (ValueError, FileNotFoundError) as exc:
            refused += 1
            _assert_names(exc, ann, images, what=what)
        else:  # accepted: then what was read is a well-formed target
            for image, target in items:
                assert torch.isfinite(target["boxes"]).all(), what
                assert target["labels"].dtype == torch.int64, what
        assert _digest(ann) == before, f"{what}: loading changed the file"
    assert 100 < refused < 300, "the mutations should mostly, but not always, break the file"


@pytest.mark.parametrize("damage", ["empty", "cut", "random bytes", "not an object", "binary"])
def test_an_annotation_file_that_is_not_json_fails_naming_it(coco, tmp_path, damage):
    images, original = coco
    text = original.read_bytes()
    content = {"empty": b"", "cut": text[: len(text) // 2], "random bytes": random.Random(1).randbytes(500),
               "not an object": b"[1, 2, 3]", "binary": b"\xff\xfe\x00" * 50}[damage]
    ann = tmp_path / "ann.json"
    ann.write_bytes(content)
    with pytest.raises(ValueError) as exc_info:
        _load_all(images, ann)
    _assert_names(exc_info.value, ann, what=damage)


@pytest.mark.parametrize("damage", ["empty", "cut", "random bytes", "text", "other size"])
def test_a_damaged_image_fails_naming_it_or_reads_its_pixels_exactly(coco, tmp_path, damage):
    images, ann = coco
    folder = tmp_path / "images"
    shutil.copytree(images, folder)
    victim = sorted(folder.iterdir())[0]
    pixels = Image.open(victim).convert("RGB").tobytes()
    data = victim.read_bytes()
    rng = random.Random(2)
    cuts = sorted(rng.sample(range(1, len(data)), 10)) if damage == "cut" else [None]
    for cut in cuts:
        if damage == "other size":
            Image.new("RGB", (7, 5)).save(victim, format="PNG")
        else:
            victim.write_bytes({"empty": b"", "cut": data[:cut or 0], "random bytes": rng.randbytes(300),
                                "text": b"not an image\n"}[damage])
        try:
            items = _load_all(folder, ann)
        except ValueError as exc:
            assert str(victim) in str(exc), str(exc)
        else:  # only a cut past the pixel data (into the end marker) may still read, and then exactly
            assert damage == "cut", f"{damage}: a damaged image was read"
            dataset = CocoDetection(folder, ann)
            index = next(i for i, image_id in enumerate(dataset.ids)
                         if dataset.coco.imgs[image_id]["file_name"] == victim.name)
            assert items[index][0].tobytes() == pixels, f"cut at {cut}: wrong pixels"


def test_a_run_log_torn_at_the_end_keeps_its_records_and_other_damage_names_the_line(tmp_path):
    log = tmp_path / "log.jsonl"
    entries = [{"epoch": e, "loss": 1.0 / (e + 1)} for e in range(4)]
    whole = "".join(json.dumps(e) + "\n" for e in entries)
    for cut in range(len(whole) - len(json.dumps(entries[-1])), len(whole) - 1):  # killed while writing the last
        log.write_text(whole[:cut])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert read_log(log) == entries[:3], f"cut at {cut}"
    log.write_text(whole[:-5])
    with pytest.warns(UserWarning, match="cut short"):
        truncate_log(log, 10)  # a resume rewrites the log without the torn line
    assert read_log(log) == entries[:3] and log.read_text().endswith("\n")

    for garbage in ("{not json", "[1, 2]", "42"):
        lines = whole.splitlines()
        lines[1] = garbage
        log.write_text("\n".join(lines) + "\n")
        before = _digest(log)
        with pytest.raises(ValueError, match="line 2") as exc_info:
            read_log(log)
        _assert_names(exc_info.value, log, what=garbage)
        assert _digest(log) == before
    log.write_bytes(b"\xff\xfe" * 40)
    with pytest.raises(ValueError, match="not text") as exc_info:
        read_log(log)
    _assert_names(exc_info.value, log)


def test_enwik8_that_is_not_the_file_names_the_flag(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"<mediawiki>" * 10)
    for path, error in ((tmp_path, FileNotFoundError), (tmp_path / "missing", FileNotFoundError), (short, ValueError)):
        with pytest.raises(error, match="--enwik8") as exc_info:
            load_splits(argparse.Namespace(enwik8=str(path), corpus_bytes=0))
        _assert_names(exc_info.value, path)


ARGV = ["vit", "--seeds", "0", "--train-steps", "10", "--out", "runs/x"]
RECORD = dict(seed=0, stage="patch", calibration_steps=0, finetune_steps=0, top1=0.9, kept=0.95,
              fraction_of_training_steps=0.0)


def test_a_damaged_results_json_is_refused_by_resume_naming_it(tmp_path):
    path = tmp_path / "results.json"
    good = {"argv": ARGV, "records": [RECORD]}
    path.write_text(json.dumps(good))
    assert previous_records(path, ARGV) == [RECORD]  # the undamaged file resumes
    text = json.dumps(good)
    rng = random.Random(3)
    damaged = [b"", text[: len(text) // 2].encode(), rng.randbytes(200), b"[]", b'{"argv": []}',
               json.dumps({"argv": ARGV, "records": 3}).encode(),
               json.dumps({"argv": ARGV, "records": [{"seed": 0}]}).encode(),
               json.dumps({"argv": 5, "records": [RECORD]}).encode()]
    for content in damaged:
        path.write_bytes(content)
        with pytest.raises(SystemExit) as exc_info:
            previous_records(path, ARGV)
        assert str(path) in str(exc_info.value.code), content
        assert path.read_bytes() == content


def test_results_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A run killed while writing results.json leaves the previous one, which --resume can still read."""
    path = tmp_path / "results.json"
    write_text_atomic(path, "old")
    real_write = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "a new results file")
    monkeypatch.undo()
    assert path.read_text() == "old"
