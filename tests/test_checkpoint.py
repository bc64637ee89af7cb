"""Checkpoints round-trip exactly, replace each other atomically, and refuse corrupt files."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from decentral.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_meta, save_checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "f16": torch.randn(2, 2, dtype=torch.float16),
        "i64": torch.arange(10, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "transposed": base.t(),  # a non-contiguous view
        "shared_a": base,  # shares storage with shared_b and transposed
        "shared_b": base.view(24),
        "with_grad": torch.ones(3, requires_grad=True),
    }


def _assert_equal(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor.detach()), name


def test_round_trip(tmp_path):
    tensors = _tensors()
    meta = {"round": 7, "recipe": {"lr": 0.003, "name": "noloco"}, "peers": ["a", "b"], "none": None}
    out = save_checkpoint(tmp_path / "ckpt", tensors, meta)
    assert out == tmp_path / "ckpt"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tensors.safetensors"]
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk["format"] == 1 and len(on_disk["tensors_sha256"]) == 64

    loaded, loaded_meta = load_checkpoint(out)
    _assert_equal(loaded, tensors)
    assert loaded_meta == meta
    assert all(t.device.type == "cpu" for t in loaded.values())


def test_loaded_tensors_do_not_alias_each_other(tmp_path):
    base = torch.zeros(4)
    save_checkpoint(tmp_path / "ckpt", {"a": base, "b": base}, {})
    loaded, _ = load_checkpoint(tmp_path / "ckpt")
    loaded["a"] += 1
    assert torch.equal(loaded["b"], torch.zeros(4))


def test_overwrite_keeps_the_new_one_and_leaves_nothing_behind(tmp_path):
    target = tmp_path / "ckpt"
    save_checkpoint(target, {"w": torch.zeros(3)}, {"round": 1})
    save_checkpoint(target, {"w": torch.ones(3), "extra": torch.arange(2)}, {"round": 2})
    tensors, meta = load_checkpoint(target)
    assert meta == {"round": 2}
    _assert_equal(tensors, {"w": torch.ones(3), "extra": torch.arange(2)})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp or set-aside directories, hidden or not


def test_crash_between_renames_still_loads_the_old_checkpoint(tmp_path):
    target = tmp_path / "ckpt"
    save_checkpoint(target, {"w": torch.zeros(3)}, {"round": 1})
    target.rename(tmp_path / ".ckpt.old")  # where a save sets the old checkpoint aside before renaming the new in

    tensors, meta = load_checkpoint(target)
    assert meta == {"round": 1}

    save_checkpoint(target, {"w": torch.ones(3)}, {"round": 2})
    assert load_checkpoint(target)[1] == {"round": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_failed_save_keeps_the_old_checkpoint(tmp_path):
    target = tmp_path / "ckpt"
    save_checkpoint(target, {"w": torch.zeros(3)}, {"round": 1})
    with pytest.raises(TypeError):
        save_checkpoint(target, {"w": torch.ones(3)}, {"not json": object()})
    assert load_checkpoint(target)[1] == {"round": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_flipped_byte_is_a_checksum_mismatch(tmp_path):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.randn(100)}, {})
    path = target / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum") as info:
        load_checkpoint(target)
    assert str(path) in str(info.value)


def test_truncated_tensor_file(tmp_path):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.randn(100)}, {})
    path = target / "tensors.safetensors"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(target)


def test_unparseable_tensor_file_with_matching_checksum(tmp_path):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.randn(100)}, {})
    garbage = b"not a safetensors file"
    (target / "tensors.safetensors").write_bytes(garbage)
    meta = json.loads((target / "meta.json").read_text())
    meta["tensors_sha256"] = hashlib.sha256(garbage).hexdigest()
    del meta["meta_sha256"]  # (as a checkpoint saved before meta.json had its own)
    (target / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="corrupt checkpoint .*tensors.safetensors: "):
        load_checkpoint(target)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_checkpoint(tmp_path / "nowhere")
    assert "nowhere" in str(info.value)


@pytest.mark.parametrize("name", ["meta.json", "tensors.safetensors"])
def test_missing_file(tmp_path, name):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(1)}, {})
    (target / name).unlink()
    with pytest.raises(CheckpointError, match=name):
        load_checkpoint(target)


def test_garbage_meta(tmp_path):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(1)}, {})
    (target / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON") as info:
        load_checkpoint(target)
    assert "meta.json" in str(info.value)


def test_a_meta_changed_after_the_save_is_refused_even_as_valid_json(tmp_path):
    """A flipped digit in meta.json (the step a run resumes at, its schedule) read as valid JSON, and a run
    resumed from it at the wrong step; now meta.json's own checksum refuses it, for a reader of the meta alone
    too (`experts add` reads a checkpoint's domain from it)."""
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(1)}, {"sync": {"step": 100}})
    path = target / "meta.json"
    path.write_text(path.read_text().replace('"step": 100', '"step": 900'))
    for read in (load_checkpoint, read_checkpoint_meta):
        with pytest.raises(CheckpointError, match="checksum mismatch") as info:
            read(target)
        assert str(path) in str(info.value)


def test_a_checkpoint_saved_before_meta_had_its_own_checksum_still_loads(tmp_path):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.ones(2)}, {"sync": {"step": 100}})
    path = target / "meta.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "meta_sha256"}))
    tensors, meta = load_checkpoint(target)
    assert meta == {"sync": {"step": 100}} and torch.equal(tensors["w"], torch.ones(2))


def test_meta_without_checksum(tmp_path):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(1)}, {})
    (target / "meta.json").write_text(json.dumps({"round": 1}))
    with pytest.raises(CheckpointError):
        load_checkpoint(target)


def _write_model_files(folder):
    """A files hook: what a Hugging Face model's save_pretrained layout looks like, in miniature."""
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "shards").mkdir()
    (folder / "shards" / "model-00001-of-00001.safetensors").write_bytes(b"weights" * 100)


def _read_model_files(folder):
    return {"model.bytes": torch.tensor(list((folder / "shards" / "model-00001-of-00001.safetensors").read_bytes()))}


def test_files_of_a_hook_are_written_in_the_same_swap_and_read_back(tmp_path):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(2)}, {"round": 3}, files=_write_model_files)
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()) == [
        "config.json", "meta.json", "shards/model-00001-of-00001.safetensors", "tensors.safetensors"]
    on_disk = json.loads((target / "meta.json").read_text())
    assert on_disk["files_sha256"]["config.json"] == hashlib.sha256(b'{"model_type": "llama"}').hexdigest()
    tensors, meta = load_checkpoint(target, files=_read_model_files)
    assert meta == {"round": 3}
    assert bytes(tensors["model.bytes"].tolist()) == b"weights" * 100 and torch.equal(tensors["w"], torch.zeros(2))
    save_checkpoint(target, {"w": torch.ones(2)}, {"round": 4})  # a checkpoint without files replaces it whole
    assert sorted(p.name for p in target.iterdir()) == ["meta.json", "tensors.safetensors"]


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_file_of_a_hook_is_refused(tmp_path, damage):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(2)}, {}, files=_write_model_files)
    path = target / "shards" / "model-00001-of-00001.safetensors"
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[3] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    with pytest.raises(CheckpointError, match="checksum mismatch" if damage == "flip" else "is missing") as info:
        load_checkpoint(target, files=_read_model_files)
    assert "model-00001-of-00001.safetensors" in str(info.value)


def test_a_failing_hook_keeps_the_old_checkpoint_and_may_not_write_ours(tmp_path):
    target = save_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(2)}, {"round": 1})

    def broken(folder):
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(target, {"w": torch.ones(2)}, {"round": 2}, files=broken)
    with pytest.raises(ValueError, match="meta.json"):
        save_checkpoint(target, {"w": torch.ones(2)}, {"round": 2}, files=lambda f: (f / "meta.json").write_text("{}"))
    assert load_checkpoint(target)[1] == {"round": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


A_SAVE_PAST_THE_DISKS_ROOM = """
import resource, signal, sys, torch
from decentral.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
folder = sys.argv[1]
save_checkpoint(folder, {"w": torch.ones(10)}, {"step": 1})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as one on a full disk does
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    save_checkpoint(folder, {"w": torch.ones(1 << 20)}, {"step": 2})
except CheckpointError as e:
    print("said:", e)
tensors, meta = load_checkpoint(folder)
print("kept:", meta["step"], tensors["w"].numel())
"""


def test_a_checkpoint_that_does_not_fit_on_the_disk_is_a_checkpoint_error_and_the_last_one_is_kept(tmp_path):
    """safetensors' write error (a full disk's: "No space left on device") is no OSError: the worker ended with
    its traceback. It is a CheckpointError naming the folder now (the command line says it in one line), and the
    checkpoint saved before is still there. (In a process of its own: the file size limit stands for a full disk.)"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", A_SAVE_PAST_THE_DISKS_ROOM, str(tmp_path / "checkpoint")],
                          capture_output=True, text=True, timeout=120)
    assert f"said: could not write the checkpoint {tmp_path / 'checkpoint'}: " in done.stdout, done.stdout + done.stderr
    assert "kept: 1 10" in done.stdout and not list(tmp_path.glob(".checkpoint.tmp-*"))
