"""Where a DETR ResNet starts from: torchvision's ImageNet weights by name (a mocked download: nothing here touches
the network), a local file, or random initialisation only when asked; and what the trainer says about it."""
import argparse
import urllib.error

import pytest
import torch
import torchvision

from linear_mha.integrations import distributed as dist_utils
from linear_mha.integrations.detr import backbone_weights
from linear_mha.integrations.detr.backbone_weights import WeightsUnavailable, fetch_on_main_first, imagenet_weights
from linear_mha.integrations.detr.config import parse_args
from linear_mha.integrations.detr.detr import build_model

SMALL_DETR = ["--backbone", "resnet18", "--hidden-dim", "32", "--nheads", "2", "--enc-layers", "1", "--dec-layers",
              "1", "--dim-feedforward", "32", "--num-queries", "3", "--num-classes", "3"]


def _torchvision_file_contents(seed):
    """What torchvision's resnet18-f37072fd.pth holds: every tensor of the classifier, BatchNorm statistics and
    num_batches_tracked included; seeded random values stand in for the trained ones."""
    torch.manual_seed(seed)
    net = torchvision.models.resnet18()
    state = net.state_dict()
    for key, value in state.items():
        if key.endswith(("running_mean", "running_var")):  # else they would equal a fresh backbone's 0 and 1
            value.copy_(torch.rand_like(value) + 0.5)
    return state


def _body(model):
    return model.backbone[0].body.state_dict()


def _assert_starts_from(model, state):
    body = _body(model)
    assert body.keys() == {k for k in state if not k.startswith("fc.") and not k.endswith("num_batches_tracked")}
    assert all(torch.equal(body[k], state[k]) for k in body)


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """An empty torch.hub cache, so that a fetch by name has to go through the (mocked) download."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    assert str(torch.hub.get_dir()).startswith(str(tmp_path))
    return tmp_path / "torch-home"


def _mock_download(monkeypatch, state=None, error=None):
    """torch.hub's download (which torchvision's weights API calls) writes ``state`` or raises ``error``."""
    urls = []

    def download(url, dst, hash_prefix=None, progress=True):
        urls.append(url)
        if error is not None:
            raise error
        torch.save(state, dst)
    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    return urls


def test_a_torchvision_file_and_a_detr_checkpoint_start_the_resnet_from_their_weights(tmp_path):
    state = _torchvision_file_contents(seed=1)
    torch.save(state, tmp_path / "resnet18.pth")
    model, _, _ = build_model(parse_args(SMALL_DETR + ["--backbone-weights", str(tmp_path / "resnet18.pth")]))
    _assert_starts_from(model, state)
    assert not torch.equal(_body(build_model(parse_args(SMALL_DETR))[0])["conv1.weight"], state["conv1.weight"])
    # a DETR checkpoint (official layout: 'model' with backbone.0.body.*, 'args' a Namespace) gives its backbone
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(lr=1e-4)}, tmp_path / "detr.pth")
    again, _, _ = build_model(parse_args(SMALL_DETR + ["--backbone-weights", str(tmp_path / "detr.pth")]))
    _assert_starts_from(again, state)


def test_a_file_of_another_resnet_is_refused_naming_the_option(tmp_path):
    deeper = _torchvision_file_contents(seed=1)
    deeper["layer1.2.conv1.weight"] = torch.zeros(64, 64, 3, 3)  # a ResNet-34 has a third layer1 block
    torch.save(deeper, tmp_path / "deeper.pth")
    with pytest.raises(ValueError, match=r"--backbone-weights .*deeper.pth does not fit backbone 'resnet18'.*"
                                         r"unexpected \['layer1.2.conv1.weight'\]"):
        build_model(parse_args(SMALL_DETR + ["--backbone-weights", str(tmp_path / "deeper.pth")]))
    torch.save(_torchvision_file_contents(seed=1), tmp_path / "resnet18.pth")
    with pytest.raises(ValueError, match="--backbone-weights .*resnet18.pth does not fit backbone 'resnet50'"):
        build_model(parse_args(SMALL_DETR + ["--backbone", "resnet50", "--backbone-weights",
                                             str(tmp_path / "resnet18.pth")]))
    with pytest.raises(FileNotFoundError, match="--backbone-weights .*missing.pth does not exist"):
        build_model(parse_args(SMALL_DETR + ["--backbone-weights", str(tmp_path / "missing.pth")]))


def test_imagenet_weights_are_fetched_once_by_name_through_torchvision(torch_home, monkeypatch):
    state = _torchvision_file_contents(seed=2)
    urls = _mock_download(monkeypatch, state)
    model, _, _ = build_model(parse_args(SMALL_DETR + ["--backbone-weights", "imagenet"]))
    _assert_starts_from(model, state)
    assert urls == [torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url]
    assert (torch_home / "hub" / "checkpoints" / "resnet18-f37072fd.pth").exists()
    build_model(parse_args(SMALL_DETR + ["--backbone-weights", "imagenet"]))
    assert len(urls) == 1  # the second build reads torch.hub's cache
    # DETR-R50 starts from the file the official DETR starts from (torchvision's pretrained=True)
    assert imagenet_weights("resnet50").url == "https://download.pytorch.org/models/resnet50-0676ba61.pth"
    with pytest.raises(ValueError, match="backbone 'tiny' has no ImageNet weights .* --pretrain-backbone"):
        build_model(parse_args(["--backbone", "tiny", "--num-classes", "3", "--backbone-weights", "imagenet"]))


def test_offline_the_error_names_the_file_and_both_ways_on(torch_home, monkeypatch, tmp_path):
    urls = _mock_download(monkeypatch, error=urllib.error.URLError("Temporary failure in name resolution"))
    with pytest.raises(WeightsUnavailable) as caught:
        build_model(parse_args(SMALL_DETR + ["--backbone-weights", "imagenet"]))
    message = str(caught.value)
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth could not be downloaded" in message
    assert "Temporary failure in name resolution" in message
    assert "--backbone-weights PATH" in message and "--backbone-weights none" in message
    assert str(torch_home / "hub" / "checkpoints" / "resnet18-f37072fd.pth") in message
    # The trainer on COCO defaults to them, and stops before reading any data (this COCO folder does not exist).
    from linear_mha.integrations.detr.train import main
    with pytest.raises(WeightsUnavailable, match="ResNet50_Weights.IMAGENET1K_V1.*--backbone-weights PATH"):
        main(["--coco-path", str(tmp_path / "coco"), "--output-dir", str(tmp_path / "run"), "--no-progress"])
    assert urls[-1].endswith("resnet50-0676ba61.pth")


def test_the_trainer_starts_a_resnet_from_imagenet_unless_told_otherwise(monkeypatch):
    fetched = []
    monkeypatch.setattr(backbone_weights, "fetch_on_main_first", lambda name, progress=True: fetched.append(name))

    def resolved(argv):
        args = parse_args(argv)
        backbone_weights.resolve_backbone_weights(args)
        return args.backbone_weights
    assert resolved(["--coco-path", "unused"]) == "imagenet" and fetched == ["resnet50"]
    assert resolved(["--backbone", "resnet101", "--train-ann", "a.json"]) == "imagenet"
    assert resolved(["--backbone", "resnet18"]) == "imagenet"  # on the synthetic set too, never pretrained there
    assert parse_args(["--backbone", "resnet18"]).pretrain_backbone == 0
    fetched.clear()
    assert resolved(["--coco-path", "unused", "--backbone-weights", "none"]) == "none"
    assert resolved(["--coco-path", "unused", "--pretrained", "detr-r50.pth"]) is None  # the checkpoint has it
    assert resolved(["--coco-path", "unused", "--resume", "checkpoint.pth"]) is None
    assert resolved(["--coco-path", "unused", "--backbone-weights", "r50.pth"]) == "r50.pth"
    assert resolved(["--backbone", "resnet18", "--pretrain-backbone", "3"]) is None  # backbone_cache refuses it
    assert resolved([]) is None and parse_args([]).pretrain_backbone == 1000  # the small backbone: backbone_cache
    assert fetched == []


def test_the_other_processes_wait_for_the_main_one_and_raise_its_error(torch_home, monkeypatch):
    urls = _mock_download(monkeypatch, state=_torchvision_file_contents(seed=3))
    monkeypatch.setattr(dist_utils, "is_main_process", lambda: False)
    monkeypatch.setattr(dist_utils, "all_gather_json", lambda obj: ["the main process's error", obj])
    with pytest.raises(WeightsUnavailable, match="the main process's error"):
        fetch_on_main_first("resnet18")
    assert urls == []  # a second process never downloads on its own
    monkeypatch.setattr(dist_utils, "all_gather_json", lambda obj: [None, obj])
    fetch_on_main_first("resnet18")
    assert urls == []  # the main one has the file: build_backbone reads it from the cache
