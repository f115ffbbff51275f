"""``trt-sora info``: registered models, recipes, presets; and which backends are installed."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="list models, recipes and installed backends")
    p.set_defaults(func=run)


def run(args) -> int:
    import importlib.util

    from trt_sora.config import list_recipes
    from trt_sora.models import list_models

    print("models:  " + ", ".join(list_models()))
    print("recipes: " + ", ".join(sorted(list_recipes())))
    for mod, what in (("torch", "export/calibrate"), ("onnxruntime", "ORT parity/runtime"),
                      ("tensorrt", "TensorRT build/run"), ("tensorrt_rtx", "TensorRT-RTX build")):
        ok = importlib.util.find_spec(mod) is not None
        print(f"{mod:12s} {'yes' if ok else 'no ':3s}  ({what})")
    return 0
