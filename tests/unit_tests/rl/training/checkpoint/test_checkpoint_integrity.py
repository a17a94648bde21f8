"""Corrupted checkpoint bytes, NaN values, a renamed iteration directory, a changed --train-iters and a changed
--hidden-size are named CheckpointErrors, never silent wrong resumes."""
from __future__ import annotations

import json
import logging
import re

import pytest
import torch

import ckpt_tiny_model as T
from megatron.rl.runtime import versions
from megatron.rl.training.checkpoint import integrity
from megatron.rl.training.checkpoint.save_load import CheckpointError, check_model_args, load_checkpoint, save_checkpoint

ARCH = T.Arch(num_layers=2, hidden_size=32)

# a file of the checkpoint besides the shards: the common state (0.16.1) or torch DCP metadata (0.19)
UNSHARDED_FILE = ".metadata" if versions.is_0_19() else "common.pt"


@pytest.fixture
def saved(tmp_path, dist1):
    """A checkpoint of iteration 1 (after one training step) and the run that wrote it."""
    chunks, opt, sched = T.build(ARCH, distopt=False)
    T.train_step(chunks, opt, sched, 0)
    save_checkpoint(tmp_path, 1, chunks, opt, sched, model_args=ARCH.model_args())
    return tmp_path, chunks


def _fresh():
    return T.build(ARCH, distopt=False, seed=99)


def _overwrite(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_manifest_lists_every_file_and_loads_clean(saved):
    root, chunks = saved
    ckpt = root / "iter_0000001"
    manifest = json.loads((ckpt / integrity.MANIFEST_FILENAME).read_text())
    files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()} - {integrity.MANIFEST_FILENAME}
    assert set(manifest["files"]) == files and any(f.endswith(".distcp") for f in files)
    assert manifest["algorithm"] in ("xxh3_128", "blake2b")
    for name, entry in manifest["files"].items():
        assert entry["size"] == (ckpt / name).stat().st_size
        assert entry["hash"] == integrity.hash_file(ckpt / name, manifest["algorithm"])
    c2, o2, s2 = _fresh()
    loaded = load_checkpoint(root, c2, o2, s2)
    assert loaded.iteration == 1
    assert all(a.equal(b) for a, b in zip(chunks[0].parameters(), c2[0].parameters()))


def _refused_before_reading(root, match):
    """A fresh run whose load_checkpoint(root) raised CheckpointError matching ``match`` before reading a weight."""
    c2, o2, s2 = _fresh()
    before = [p.detach().clone() for p in c2[0].parameters()]
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(root, c2, o2, s2)
    assert all(a.equal(b) for a, b in zip(before, c2[0].parameters()))  # nothing was read
    return c2, o2, s2


def _tensor_data(ckpt, prefix):
    """(file, offset, nbytes) of the raw bytes of the first stored tensor whose name starts with ``prefix``.

    A torch_dist item is a torch.save zip inside a .distcp file; its ``data/0`` member holds the raw values."""
    import io
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    key, info = next((k, v) for k, v in sorted(md.storage_data.items(), key=lambda kv: kv[0].fqn)
                     if k.fqn.startswith(prefix))
    path = ckpt / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    z = zipfile.ZipFile(io.BytesIO(blob))
    member = next(m for m in z.infolist() if m.filename.endswith("/data/0"))
    header = blob[member.header_offset:member.header_offset + 30]
    name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    return path, info.offset + member.header_offset + 30 + name_len + extra_len, member.file_size


def test_overwritten_weight_bytes_are_refused_before_loading(saved):
    """4 KB of a .distcp file overwritten (1,024 NaN weights, unchecked) is caught."""
    root, _ = saved
    ckpt = root / "iter_0000001"
    path, offset, nbytes = _tensor_data(ckpt, "embedding.word_embeddings.weight")
    assert nbytes >= 4096
    original = path.read_bytes()
    _overwrite(path, offset, b"\xff" * 4096)  # 1,024 float32 NaNs
    c2, o2, s2 = _refused_before_reading(root, rf"{path.name} does not match its checksum.*"
                                               rf"--no-verify-checkpoint-checksums")
    # without the manifest check, the value scan names the NaNs instead of training on them
    with pytest.raises(CheckpointError, match=r"embedding\.word_embeddings\.weight has 1024 non-finite"):
        load_checkpoint(root, *_fresh(), verify_checksums=False)
    path.write_bytes(original)
    truncated = ckpt / UNSHARDED_FILE  # sizes are checked too
    truncated.write_bytes(truncated.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"{re.escape(UNSHARDED_FILE)} has \d+ bytes"):
        load_checkpoint(root, c2, o2, s2)


def test_flipped_optimizer_state_bytes_are_refused(saved):
    """Flipped bytes in the optimizer state (exp_avg values of 1e29: a stuck run) are caught. Such values are
    finite, so only the checksum can tell."""
    root, _ = saved
    path, offset, nbytes = _tensor_data(root / "iter_0000001", "optimizer.state.exp_avg.")
    with open(path, "r+b") as f:
        for i in range(3, min(nbytes, 400), 4):  # the high byte of float32 values: exponent bits
            f.seek(offset + i)
            f.write(bytes([0x70]))
    c2, o2, s2 = _fresh()
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        load_checkpoint(root, c2, o2, s2)
    loaded = load_checkpoint(root, c2, o2, s2, verify_checksums=False)  # what happened before: loads "fine"
    big = max(float(v.abs().max()) for st in o2.optimizer.state.values() for k, v in st.items() if k == "exp_avg")
    assert loaded.iteration == 1 and big > 1e20


def test_non_finite_values_are_refused_even_without_checksums(tmp_path, dist1):
    """The value scan catches what checksums cannot (a NaN saved as such, or --no-verify-checkpoint-checksums)."""
    chunks, opt, sched = T.build(ARCH, distopt=False)
    T.train_step(chunks, opt, sched, 0)
    with torch.no_grad():
        next(chunks[0].parameters()).view(-1)[3] = float("nan")
    save_checkpoint(tmp_path / "nan", 1, chunks, opt, sched)
    c2, o2, s2 = _fresh()
    with pytest.raises(CheckpointError, match=r"non-finite value\(s\).*earlier iteration"):
        load_checkpoint(tmp_path / "nan", c2, o2, s2, verify_checksums=False)

    chunks, opt, sched = T.build(ARCH, distopt=False)
    T.train_step(chunks, opt, sched, 0)
    state = opt.optimizer.state
    p = next(iter(state))
    state[p]["exp_avg_sq"].view(-1)[0] = -1e29
    save_checkpoint(tmp_path / "neg", 1, chunks, opt, sched)
    c2, o2, s2 = _fresh()
    with pytest.raises(CheckpointError, match="exp_avg_sq.*negative"):
        load_checkpoint(tmp_path / "neg", c2, o2, s2)
    load_checkpoint(tmp_path / "neg", c2, o2, s2, load_optimizer=False)  # the weights alone are fine


def _as_saved_before_manifests(ckpt):
    """Make ``ckpt`` what a version before manifests saved: no checksums.json, no record of one in its metadata."""
    (ckpt / integrity.MANIFEST_FILENAME).unlink()
    common = torch.load(ckpt / "common.pt", weights_only=False)
    del common["checkpoint_info"][integrity.MANIFEST_INFO_KEY]
    torch.save(common, ckpt / "common.pt")


@pytest.mark.skipif(versions.is_0_19(), reason="checkpoints from before manifests were all saved by megatron-core "
                    "0.16.1 (common.pt); 0.19 writes its common state into the sharded files")
def test_checkpoint_saved_before_manifests_loads_with_one_warning(saved, caplog, monkeypatch):
    root, chunks = saved
    _as_saved_before_manifests(root / "iter_0000001")
    monkeypatch.setattr(integrity, "_warned_no_manifest", False)
    with caplog.at_level(logging.WARNING, logger=integrity.__name__):
        for _ in range(2):
            c2, o2, s2 = _fresh()
            assert load_checkpoint(root, c2, o2, s2).iteration == 1
    assert sum("no checksums.json" in r.getMessage() for r in caplog.records) == 1
    (root / "iter_0000001" / integrity.MANIFEST_FILENAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="malformed"):
        load_checkpoint(root, *_fresh())


def test_a_deleted_manifest_of_a_checkpoint_saved_with_one_is_refused(saved):
    """A flipped byte in a .distcp file and the manifest deleted loaded with the "saved before checksum manifests
    existed" warning: the checkpoint's own metadata says it was saved with one."""
    root, chunks = saved
    ckpt = root / "iter_0000001"
    path, offset, _ = _tensor_data(ckpt, "embedding.word_embeddings.weight")
    _overwrite(path, offset, bytes([path.read_bytes()[offset] ^ 0x01]))  # a flipped bit: still finite
    (ckpt / integrity.MANIFEST_FILENAME).unlink()
    c2, o2, s2 = _refused_before_reading(root, r"has no checksums\.json, but it was saved with one.*"
                                               r"--no-verify-checkpoint-checksums to load it unverified")
    assert load_checkpoint(root, c2, o2, s2, verify_checksums=False).iteration == 1  # the documented way out


def test_files_the_manifest_does_not_list_are_named(saved):
    root, _ = saved
    ckpt = root / "iter_0000001"
    (ckpt / "__9_0.distcp").write_bytes(b"x" * 10)
    (ckpt / "notes").mkdir()
    (ckpt / "notes" / "a.txt").write_text("hi")
    with pytest.raises(CheckpointError, match=r"holds 2 file\(s\) its checksums\.json does not list: __9_0\.distcp, "
                                              r"notes/a\.txt \(added or renamed after the save\)"):
        load_checkpoint(root, *_fresh())
    assert load_checkpoint(root, *_fresh(), verify_checksums=False).iteration == 1


def test_iteration_must_match_the_directory_name(saved):
    """iter_0000020 holding iteration-5 data is refused, not loaded as iteration 5."""
    root, _ = saved
    (root / "iter_0000001").rename(root / "iter_0000020")
    (root / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(CheckpointError, match=r"holds iteration 1 but its directory name says 20"):
        load_checkpoint(root, *_fresh())


def test_changed_train_iters_on_resume_is_a_named_error(saved):
    """A different --train-iters changes the LR/WD schedule: a named error, not megatron-core's AssertionError."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    root, _ = saved

    def scheduler(opt, steps, **kw):  # flags as training/optimizer.py passes them (megatron-core's default differs)
        kw = {"use_checkpoint_opt_param_scheduler": False, "override_opt_param_scheduler": False, **kw}
        return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                                       lr_decay_steps=steps, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                       wd_incr_steps=steps, wd_incr_style="constant", **kw)

    chunks, opt, _ = _fresh()
    with pytest.raises(CheckpointError, match=r"lr_decay_steps is 20 in the checkpoint but 30 now.*--train-iters.*"
                                              r"--use-checkpoint-opt-param-scheduler"):
        load_checkpoint(root, chunks, opt, scheduler(opt, 30))
    keep = scheduler(opt, 30, use_checkpoint_opt_param_scheduler=True)
    assert load_checkpoint(root, chunks, opt, keep).loaded_scheduler and keep.lr_decay_steps == 20
    new = scheduler(opt, 30, override_opt_param_scheduler=True)
    assert load_checkpoint(root, chunks, opt, new).loaded_scheduler and new.lr_decay_steps == 30


def test_hidden_size_mismatch_names_hidden_size_not_the_derived_ffn_size(tmp_path):
    """--hidden-size 64 vs 32 is reported as hidden_size (not ffn_hidden_size, which sorts before it)."""
    saved = {"hidden_size": 64, "ffn_hidden_size": 256, "kv_channels": 16, "num_layers": 2}
    now = {"hidden_size": 32, "ffn_hidden_size": 128, "kv_channels": 8, "num_layers": 2}
    with pytest.raises(CheckpointError, match=r"hidden_size is 64 in the checkpoint but 32.*pass --hidden-size 64"):
        check_model_args(saved, now, tmp_path)
    with pytest.raises(CheckpointError, match=r"ffn_hidden_size is 256.*--ffn-hidden-size 256"):
        check_model_args(saved, {**saved, "ffn_hidden_size": 128}, tmp_path)
    with pytest.raises(CheckpointError, match=r"add --swiglu"):
        check_model_args({"swiglu": True}, {"swiglu": False}, tmp_path)


def test_unverified_loads_still_name_unreadable_files(saved):
    """With --no-verify-checkpoint-checksums the loader's own errors remain (what the manifest now catches first)."""
    root, _ = saved
    (root / "iter_0000001" / "common.pt").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match=r"cannot read the common state of checkpoint .*iter_0000001"):
        load_checkpoint(root, *_fresh(), verify_checksums=False)


@pytest.mark.parametrize("algorithm", ["blake2b", "xxh3_128"])
def test_hash_file_detects_one_flipped_bit(tmp_path, algorithm):
    if algorithm == "xxh3_128" and integrity.xxhash is None:
        pytest.skip("xxhash not installed (the 'gpu' extra)")
    p = tmp_path / "f"
    data = bytearray(range(256)) * 40000  # > one read chunk
    p.write_bytes(bytes(data))
    first = integrity.hash_file(p, algorithm)
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    assert integrity.hash_file(p, algorithm) != first and len(first) == 32
