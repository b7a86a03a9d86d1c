"""Our safetensors reader and header-first writer agree with the safetensors library."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.io.dtypes import from_torch
from converters.io.safetensors_reader import SafetensorsFile
from converters.io.stream_writer import SafetensorsWriter


def test_writer_output_loads_with_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(7, 5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "b": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "c": torch.randn(2, 3, 4, dtype=torch.float16),
        "scalar": torch.tensor(3.5),
    }
    path = tmp_path / "x.safetensors"
    w = SafetensorsWriter(path, [(k, from_torch(v.dtype), tuple(v.shape)) for k, v in tensors.items()], {"format": "pt"})
    for v in tensors.values():
        raw = v.contiguous().view(torch.uint8).numpy() if v.dim() else v.reshape(1).view(torch.uint8).numpy()
        half = len(raw) // 2
        w.write(raw[:half])  # several writes per tensor
        w.write(raw[half:])
    sha = w.close()
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_file(path)
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v), k
    assert (8 + int.from_bytes(path.read_bytes()[:8], "little")) % 8 == 0, "data section is 8-byte aligned"


def test_writer_refuses_short_or_long_data(tmp_path):
    w = SafetensorsWriter(tmp_path / "x.safetensors", [("a", "F32", (2,))])
    with pytest.raises(RuntimeError):
        w.write(b"\0" * 12)
    w.write(b"\0" * 4)
    with pytest.raises(RuntimeError):
        w.close()


def test_reader_rows_and_release(tmp_path):
    t = torch.randn(4, 6, 8, dtype=torch.bfloat16)
    save_file({"t": t, "n": torch.ones(3)}, tmp_path / "y.safetensors")
    with SafetensorsFile(tmp_path / "y.safetensors") as f:
        info = f.tensors["t"]
        assert (info.rows, info.cols) == (24, 8)
        assert torch.equal(f.rows("t", 6, 12), t.reshape(24, 8)[6:12])
        f.release(info.start, info.end)
        assert torch.equal(f.tensor("t"), t)  # pages come back from the file after release
        assert torch.equal(f.tensor("n"), torch.ones(3))



def test_writer_surfaces_disk_errors_without_hanging(tmp_path):
    """A failing write is reported to the producer; queued callbacks still run."""
    w = SafetensorsWriter(tmp_path / "x.safetensors", [("a", "U8", (64 << 20,))])
    real = w._f

    def broken(data):
        raise OSError(28, "No space left on device")

    w._f = type("Broken", (), {"write": staticmethod(broken), "flush": lambda self: None, "close": lambda self: None, "fileno": lambda self: -1})()
    returned = []
    chunk = bytes(1 << 20)
    with pytest.raises(OSError):
        for _ in range(64):
            w.write(chunk, done=lambda: returned.append(1))
        w.close()
    w.abort()
    real.close()
    assert returned, "done callbacks run even after the error"
