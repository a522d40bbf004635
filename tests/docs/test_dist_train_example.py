"""The parameter-server training job (examples/parameter_server.py): the README's main command."""

from __future__ import annotations

import gzip
import importlib.util
import struct
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "parameter_server.py"
# The training job's own dependencies (the `train` extra, which `nox -s tests` installs) are imported
# outright: a missing one must fail the run, never skip it.
import matplotlib  # noqa: E402, F401
import sklearn  # noqa: E402, F401
import tqdm  # noqa: E402, F401


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("parameter_server_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def test_training_on_the_simulator_reaches_90_percent_on_the_digits(tmp_path: Path) -> None:
    result = _example().main(["--epochs", "8", "--out-dir", str(tmp_path)])
    assert result is not None
    assert result["test_accuracy"] >= 0.90, result
    assert set(result["final_loss"]) == {1, 2}  # both trainers reported their loss curves
    png = tmp_path / "loss-sim-seed0.png"  # named after its world and seed: runs do not overwrite each other
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_idx_files_are_read_as_mnist(tmp_path: Path) -> None:
    """A small MNIST-format data set (28x28 images, two classes told apart by brightness)."""
    rng = np.random.default_rng(0)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, 2, n)
        images = rng.integers(0, 60, (n, 28, 28)) + labels[:, None, None] * 150
        return images, labels

    for name, (images, labels), compress in [("train", split(96), False), ("t10k", split(40), True)]:
        _write_idx(tmp_path / f"{name}-images-idx3-ubyte", images, compress)
        _write_idx(tmp_path / f"{name}-labels-idx1-ubyte", labels, compress)
    ex = _example()
    x_train, y_train, x_test, y_test = ex.load_data(str(tmp_path))
    assert sorted(y_test.unique().tolist()) == [0, 1]
    assert x_train.shape == (96, 1, 28, 28) and x_test.shape == (40, 1, 28, 28)
    assert float(x_train.max()) <= 1.0 and y_train.dtype == torch.int64
    out = str(tmp_path / "out")
    result = ex.main(["--data-dir", str(tmp_path), "--epochs", "10", "--lr", "0.05", "--out-dir", out])
    assert result is not None and result["test_accuracy"] >= 0.9, result


def test_bad_idx_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"\x00\x00\x0d\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="not an unsigned-byte IDX file"):
        _example()._read_idx(tmp_path / "x")
