"""Model folders prepared by one user are readable by another: the image prepares them as root
at build time and runs as uid 10001 (a 0700 folder from mkdtemp once broke every container at
start). A mounted OCR_MODEL_DIR the service cannot read fails with a clear message."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.engines.paddle_models import from_directory, from_wheel
from tests.conftest import ROOT

pytestmark = pytest.mark.deploy

OTHER_UID = 10001
SETPRIV = shutil.which("setpriv")


as_other_user = pytest.mark.skipif(
    os.getuid() != 0 or SETPRIV is None, reason="needs root and setpriv to switch uid"
)


@pytest.fixture(scope="module")
def other_uid() -> None:
    """The other uid runs this checkout's code with this venv: a clone under a 0700 folder
    (mktemp -d) cannot be imported by it, whatever the model folders' modes. Then only the
    mode check runs (it alone would have caught the original bug)."""
    probe = _load_as_other_user("import app.engines.paddle_models")
    if probe.returncode != 0 and (
        "No module named 'app'" in probe.stderr or "Permission" in probe.stderr
    ):
        pytest.skip(f"uid {OTHER_UID} cannot import this checkout (a parent folder is 0700)")


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    """A folder other uids can traverse (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="ocr-model-perms-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def prepared(shared_dir: Path) -> Path:
    """Folders prepared under the strictest umask, as `prepare-models` at build time."""
    old = os.umask(0o077)
    try:
        from_wheel(shared_dir / "work" / "models", with_cls=True)
    finally:
        os.umask(old)
    return shared_dir / "work"


def test_prepared_folders_and_files_are_world_readable(prepared: Path) -> None:
    checked = 0
    for root, dirs, files in os.walk(prepared):
        for name in dirs:
            mode = stat.S_IMODE(os.stat(Path(root, name)).st_mode)
            assert mode & 0o555 == 0o555, (Path(root, name), oct(mode))
        for name in files:
            mode = stat.S_IMODE(os.stat(Path(root, name)).st_mode)  # follows the weight links
            assert mode & 0o444 == 0o444, (Path(root, name), oct(mode))
            checked += 1
    assert checked == 9  # det, rec, cls: two weight links + inference.yml each


def _load_as_other_user(code: str) -> subprocess.CompletedProcess[str]:
    cmd = [SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
           sys.executable, "-c", code]  # fmt: skip
    env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@as_other_user
def test_another_uid_loads_what_root_prepared(prepared: Path, other_uid: None) -> None:
    code = (
        "from app.engines.paddle_models import resolve\n"
        f"m = resolve('', {str(prepared / 'models')!r}, with_cls=True)\n"
        "print(m.det.name, m.rec.name, m.cls.name, m.det.digest)"
    )
    result = _load_as_other_user(code)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = from_wheel(prepared / "models", with_cls=True)
    assert result.stdout.split() == [
        expected.det.name, expected.rec.name, expected.cls.name, expected.det.digest
    ]  # fmt: skip


def _copy_as_model_dir(prepared: Path, target: Path) -> None:
    """An OCR_MODEL_DIR as an operator mounts it: det/ rec/ cls/ with real files."""
    models = from_wheel(prepared / "models", with_cls=True)
    for role, model in (("det", models.det), ("rec", models.rec), ("cls", models.cls)):
        assert model is not None
        shutil.copytree(model.path, target / role, symlinks=False)


@as_other_user
def test_read_only_model_dir_loads_and_unreadable_one_fails_clearly(
    prepared: Path, shared_dir: Path, other_uid: None
) -> None:
    mounted = shared_dir / "mounted"
    _copy_as_model_dir(prepared, mounted)
    # Read-only for the service's uid: owned by root, no write bit for anyone.
    for root, dirs, files in os.walk(mounted):
        for name in dirs:
            Path(root, name).chmod(0o555)
        for name in files:
            Path(root, name).chmod(0o444)
    mounted.chmod(0o555)
    code = (
        "from app.engines.paddle_models import resolve\n"
        f"m = resolve({str(mounted)!r}, '', with_cls=True)\n"
        "print(m.rec.name)"
    )
    result = _load_as_other_user(code)
    assert result.returncode == 0 and result.stdout.split() == [
        from_directory(mounted, True).rec.name
    ], result.stderr[-3000:]

    # A weight file its owner alone may read: a ModelFilesError naming it, not a traceback
    # from deep inside Paddle.
    (mounted / "rec" / "inference.pdiparams").chmod(0o400)
    code = (
        "from app.engines.paddle_models import ModelFilesError, resolve\n"
        "try:\n"
        f"    resolve({str(mounted)!r}, '', with_cls=True)\n"
        "except ModelFilesError as exc:\n"
        "    print('ModelFilesError:', exc)\n"
    )
    result = _load_as_other_user(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ModelFilesError:" in result.stdout
    assert f"{mounted}/rec/inference.pdiparams is not readable by uid {OTHER_UID}" in result.stdout

    # A model folder its owner alone may enter: the same, naming the folder.
    (mounted / "det").chmod(0o500)
    result = _load_as_other_user(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{mounted}/det is not readable by uid {OTHER_UID}" in result.stdout
