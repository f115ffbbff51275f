"""Family facts live in the family's file: no code in ``trt_sora/`` outside ``trt_sora/models/`` names a
family module or a module path of a particular family (stages ask the adapter). Comments and docstrings
may use a family's names as examples; code may not."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import trt_sora

PACKAGE = Path(trt_sora.__file__).parent  # the package under test (tests/mutations.py puts a copy first)

#: Modules under models/ every family shares; every other module there belongs to a family.
SHARED_MODELS = {"__init__", "base", "text"}

#: Module paths (and identifiers) of particular families: Wan's and HunyuanVideo's diffusers layouts.
FAMILY_PATHS = (
    r"condition_embedder", r"time_embedder", r"time_proj", r"patch_embedding", r"\battn[12]\b", r"ffn\.net",
    r"x_embedder", r"context_embedder", r"transformer_blocks", r"norm1_context", r"scale_shift_table",
    r"add_[kqv]_proj", r"proj_out", r"norm_out", r"\bblocks\.(\d|N\b|\*)", r"\"blocks\"", r"'blocks'",
    r"_WAN|WAN_|\bWan[A-Z0-9]\w*|Hunyuan\w*|\bhunyuan\b",
)


def family_modules() -> list[str]:
    names = {p.stem if p.is_file() else p.name for p in (PACKAGE / "models").iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    return sorted(names - SHARED_MODELS)


def patterns() -> list[re.Pattern]:
    mods = "|".join(family_modules())
    return [re.compile(rf"models\s*\.\s*({mods})\b"), re.compile(rf"models\s+import\s+.*\b({mods})\b"),
            *(re.compile(p) for p in FAMILY_PATHS)]


def code_lines(source: str) -> list[str]:
    """``source``'s lines with comments and docstrings blanked (what runs, not what explains it)."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and \
                isinstance(body[0].value.value, str):
            for i in range(body[0].lineno - 1, body[0].end_lineno):
                lines[i] = ""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return lines


def family_hits(root: Path = PACKAGE) -> list[str]:
    """``path:line: text`` of every code line outside models/ that names a family module or path."""
    pats, hits = patterns(), []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "models" or "proto" in rel.parts:
            continue
        for n, line in enumerate(code_lines(path.read_text()), 1):
            if any(p.search(line) for p in pats):
                hits.append(f"{rel}:{n}: {line.strip()}")
    return hits


def test_the_family_modules_are_known():
    assert {"wan", "wan_fp8", "hunyuan", "moving_shapes"} <= set(family_modules())


def test_no_code_outside_models_names_a_family_module_or_path():
    hits = family_hits()
    assert not hits, "family facts outside trt_sora/models/ (declare them on the family's adapter):\n" + \
        "\n".join(hits)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    """The scan is not blind: each kind of hit in code is found; the same words in docs are not."""
    (tmp_path / "models").mkdir()
    (tmp_path / "stage.py").write_text(
        '"""Docs may say blocks.0.attn1.to_q and trt_sora.models.wan."""\n'
        "from trt_sora.models import wan_fp8  # a family module\n"
        "import trt_sora.models.hunyuan\n"
        "EXCLUDE = {'condition_embedder.time_proj': 'AdaLN'}  # comment: proj_out\n"
        "BLOCK = re.compile(r'transformer_blocks')\n"
        "def f():\n"
        '    """blocks.N, proj_out"""\n'
        "    return 'blocks.3'\n")
    got = [h.split(":")[1] for h in family_hits(tmp_path)]
    assert got == ["2", "3", "4", "5", "8"]
