"""Reading checkpoint archives safely: every refusal has its own code, and nothing is left behind."""

from __future__ import annotations

import gzip
import io
import json
import struct
import tarfile
from pathlib import Path

import pytest
import torch

from converters import ArchiveLimits, ConvertOptions, ExportError, convert, samples
from converters import errors as E
from converters.archive import open_checkpoint
from tests.conftest import leftovers


@pytest.fixture(scope="module")
def good_files(model_dir):
    base = model_dir("qwen3")
    tensors = samples.make_adapter_tensors(base, rank=4)
    return base, samples.archive_files(tensors, r=4, alpha=8, meta={"run_id": "run_1", "checkpoint_id": "c1", "step": 3})


def tar_bytes(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def run_convert(tmp_path: Path, archive: Path, base: Path, limits: ArchiveLimits | None = None, **opts) -> Path:
    out = tmp_path / "out"
    convert(archive, str(base), "merged-safetensors", out, ConvertOptions(verify=False, limits=limits or ArchiveLimits(), **opts))
    return out


def expect_refusal(tmp_path, isolated_tmp, archive_bytes: bytes, base: Path, code: str, limits: ArchiveLimits | None = None, name: str = "ckpt.tar", **opts) -> ExportError:
    archive = tmp_path / name
    archive.write_bytes(archive_bytes)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ExportError) as ei:
        run_convert(tmp_path, archive, base, limits, **opts)
    assert ei.value.code == code, ei.value.message
    assert ei.value.kind == "input"
    msg = ei.value.message
    assert msg.endswith(".") and "\n" not in msg
    out = tmp_path / "out"
    assert not out.exists(), "no output directory may be left behind"
    assert leftovers(out) == []
    assert list(isolated_tmp.iterdir()) == [], "the extraction temp dir must be removed"
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing may be written beside the archive"
    return ei.value


def members(files: dict[str, bytes], *extra, skip: tuple[str, ...] = ()) -> list:
    return [reg(n, d) for n, d in files.items() if n not in skip] + list(extra)


def test_symlink_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, special("evil", tarfile.SYMTYPE, "/etc/passwd"))), base, E.ARCHIVE_SYMLINK)


def test_hardlink_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, special("evil", tarfile.LNKTYPE, "adapter_config.json"))), base, E.ARCHIVE_HARDLINK)


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE], ids=["char-device", "block-device", "fifo"])
def test_devices_and_fifos_refused(tmp_path, isolated_tmp, good_files, kind):
    base, files = good_files
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, special("dev", kind))), base, E.ARCHIVE_SPECIAL_FILE)


def test_absolute_path_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, reg("/tmp/nucleus-escape", b"x"))), base, E.ARCHIVE_ABSOLUTE_PATH)
    assert not Path("/tmp/nucleus-escape").exists()


def test_dotdot_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, reg("sub/../../escape.txt", b"x"))), base, E.ARCHIVE_PATH_TRAVERSAL)
    assert not (tmp_path.parent / "escape.txt").exists()


def test_duplicate_names_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    dup = reg("./adapter_config.json", json.dumps({"r": 4, "lora_alpha": 999}).encode())
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, dup)), base, E.ARCHIVE_DUPLICATE_MEMBER)


def test_member_over_size_cap_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    limits = ArchiveLimits(max_member_bytes=1024)
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files)), base, E.ARCHIVE_MEMBER_TOO_LARGE, limits)


def test_total_size_cap_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    total = sum(len(d) for d in files.values())
    limits = ArchiveLimits(max_total_bytes=total - 1)
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files)), base, E.ARCHIVE_TOO_LARGE, limits)


def test_compression_ratio_cap_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    bomb = reg("padding.bin.txt", b"\0" * (8 << 20))  # compresses ~1000x
    data = gzip.compress(tar_bytes(members(files, bomb)))
    err = expect_refusal(tmp_path, isolated_tmp, data, base, E.ARCHIVE_COMPRESSION_RATIO, ArchiveLimits(max_compression_ratio=20), name="ckpt.tgz")
    assert "decompression bomb" in err.message


def test_too_many_members_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    many = [reg(f"extra/{i}.txt", b"") for i in range(20)]
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, *many)), base, E.ARCHIVE_TOO_MANY_MEMBERS, ArchiveLimits(max_members=10))


@pytest.mark.parametrize("name", ["adapter_model.bin", "optimizer.pt", "state.pkl"])
def test_pickle_weights_refused(tmp_path, isolated_tmp, good_files, name):
    base, files = good_files
    err = expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, reg(name, b"\x80\x04K\x01."))), base, E.ARCHIVE_PICKLE_WEIGHTS)
    assert "safetensors" in err.message


def test_missing_marker_is_incomplete(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    err = expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, skip=("checkpoint_complete",))), base, E.ARCHIVE_INCOMPLETE)
    assert "checkpoint_complete" in err.message


def test_missing_adapter_weights(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files, skip=("adapter_model.safetensors", "checkpoint.json"))), base, E.ARCHIVE_MISSING_FILE)


def test_checksum_mismatch(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    cfg = json.loads(files["adapter_config.json"])
    cfg["lora_alpha"] = 9  # same length as 8, different bytes
    changed = dict(files, **{"adapter_config.json": json.dumps(cfg, indent=2).encode()})
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(changed)), base, E.ARCHIVE_CHECKSUM_MISMATCH)


def test_size_mismatch(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    changed = dict(files, **{"adapter_config.json": files["adapter_config.json"] + b"\n"})
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(changed)), base, E.ARCHIVE_SIZE_MISMATCH)


def test_not_a_tar(tmp_path, isolated_tmp, good_files):
    base, _ = good_files
    expect_refusal(tmp_path, isolated_tmp, b"this is not an archive at all" * 40, base, E.ARCHIVE_UNREADABLE)


def test_truncated_gzip(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    data = gzip.compress(tar_bytes(members(files)))
    expect_refusal(tmp_path, isolated_tmp, data[: len(data) // 2], base, E.ARCHIVE_UNREADABLE, name="ckpt.tar.gz")


def test_xz_is_named(tmp_path, isolated_tmp, good_files):
    import lzma

    base, files = good_files
    err = expect_refusal(tmp_path, isolated_tmp, lzma.compress(tar_bytes(members(files))), base, E.ARCHIVE_UNREADABLE, name="ckpt.tar.xz")
    assert "xz" in err.message


# --- hostile safetensors inside an otherwise valid archive --------------------------------


def st_bytes(header: dict, data: bytes, declared_len: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", declared_len if declared_len is not None else len(raw)) + raw + data


def with_weights(files: dict, weights: bytes) -> dict:
    return {n: (weights if n == "adapter_model.safetensors" else d) for n, d in files.items() if n != "checkpoint.json"}


A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    "weights,code",
    [
        (st_bytes({}, b"", declared_len=1 << 40), E.SAFETENSORS_HEADER_TOO_LARGE),
        (b"\x05\x00\x00\x00\x00\x00\x00\x00{oops", E.SAFETENSORS_BAD_HEADER),
        (st_bytes({A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}}, b"\0" * 16), E.SAFETENSORS_OFFSETS_OUT_OF_RANGE),
        (st_bytes({A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1000]}}, b"\0" * 1024), E.SAFETENSORS_OFFSETS_OUT_OF_RANGE),
        (st_bytes({A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}, B: {"dtype": "F32", "shape": [64, 4], "data_offsets": [512, 1536]}}, b"\0" * 1536), E.SAFETENSORS_OVERLAP),
        (st_bytes({A: {"dtype": "Q4", "shape": [4, 64], "data_offsets": [0, 128]}}, b"\0" * 128), E.SAFETENSORS_UNKNOWN_DTYPE),
    ],
    ids=["header-too-large", "bad-json", "out-of-range", "shape-disagrees", "overlap", "unknown-dtype"],
)
def test_hostile_safetensors(tmp_path, isolated_tmp, good_files, weights, code):
    base, files = good_files
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(with_weights(files, weights))), base, code)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_adapter_refused(tmp_path, isolated_tmp, good_files, model_dir, bad):
    base, _ = good_files
    tensors = samples.make_adapter_tensors(base, rank=4)
    tensors[B][3, 1] = bad
    files = samples.archive_files(tensors, r=4, alpha=8)
    err = expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files)), base, E.ADAPTER_NONFINITE)
    assert B in err.message


def test_unpaired_lora_refused(tmp_path, isolated_tmp, good_files):
    base, _ = good_files
    tensors = samples.make_adapter_tensors(base, rank=4)
    del tensors[B]
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(samples.archive_files(tensors, r=4, alpha=8))), base, E.ADAPTER_UNPAIRED)


def test_unknown_tensor_refused(tmp_path, isolated_tmp, good_files):
    base, _ = good_files
    tensors = samples.make_adapter_tensors(base, rank=4)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(64)
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(samples.archive_files(tensors, r=4, alpha=8))), base, E.ADAPTER_UNKNOWN_TENSOR)


def test_rank_disagreeing_with_config_refused(tmp_path, isolated_tmp, good_files):
    base, _ = good_files
    tensors = samples.make_adapter_tensors(base, rank=4)
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(samples.archive_files(tensors, r=8, alpha=8))), base, E.ADAPTER_RANK_MISMATCH)


def test_adapter_for_other_base_refused(tmp_path, isolated_tmp, model_dir):
    tensors = samples.make_adapter_tensors(model_dir("qwen3"), rank=4)
    tensors[A] = torch.randn(4, 96)  # in-features do not match the qwen3 base
    files = samples.archive_files(tensors, r=4, alpha=8)
    expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(files)), model_dir("qwen3"), E.ADAPTER_SHAPE_MISMATCH)


def test_missing_config_fields_refused(tmp_path, isolated_tmp, good_files):
    base, files = good_files
    changed = with_weights(files, files["adapter_model.safetensors"])
    changed["adapter_config.json"] = json.dumps({"r": 4}).encode()
    err = expect_refusal(tmp_path, isolated_tmp, tar_bytes(members(changed)), base, E.ADAPTER_CONFIG_INVALID)
    assert "lora_alpha" in err.message


# --- accepted forms -------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
def test_compressions_detected_by_magic_not_name(tmp_path, good_files, compression):
    base, files = good_files
    archive = samples.write_archive(tmp_path / "checkpoint.data", files, compression)  # no telling suffix
    with open_checkpoint(archive) as ck:
        assert ck.adapter_config["r"] == 4
        assert ck.meta["run_id"] == "run_1"
        import hashlib

        assert ck.source_sha256 == hashlib.sha256(archive.read_bytes()).hexdigest()
        extracted = ck.root
        assert (extracted / "adapter_model.safetensors").read_bytes() == files["adapter_model.safetensors"]
    assert not extracted.exists(), "closing the checkpoint removes its temp dir"


def test_files_inside_one_top_level_folder(tmp_path, good_files):
    base, files = good_files
    archive = samples.write_archive(tmp_path / "c.tar", {f"ckpt-000240/{n}": d for n, d in files.items()}, None)
    out = run_convert(tmp_path, archive, base)
    assert (out / "model.safetensors").is_file()


def test_extracted_files_are_private_regular_files(tmp_path, good_files):
    base, files = good_files
    archive = samples.write_archive(tmp_path / "c.tar.gz", files)
    with open_checkpoint(archive) as ck:
        for p in ck.root.iterdir():
            assert p.is_file() and not p.is_symlink()
            assert p.stat().st_mode & 0o077 == 0
