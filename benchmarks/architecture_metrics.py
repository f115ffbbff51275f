"""Issue 34's architecture measurements of the trt_sora package, and bit-identity hashes of a run folder.

    python benchmarks/architecture_metrics.py                      # table on stdout
    python benchmarks/architecture_metrics.py --out before.json    # the same as JSON (+ the table)
    python benchmarks/architecture_metrics.py --hashes RUN1 RUN2 --out hashes.json
    python benchmarks/architecture_metrics.py --hashes RUN --expect hashes.json   # exit 1 on a change

Everything is read with ``ast`` from the source files (nothing is imported): the size of
``runtime/__init__.py``, the longest functions, the import graph and its cycles (all imports, and
module-level ones only; ``if TYPE_CHECKING:`` imports never run and are left out), imports inside
functions, underscore names imported from another module, code outside ``models/`` that names a
particular family's module, and run-folder subpaths joined outside the ``RunFolder`` module.
Comments and docstrings are not code and are not scanned.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Modules of a particular family under ``models/`` (``base``, ``text`` and the registry are shared).
FAMILY_MODULES = ("wan", "wan_fp8", "hunyuan", "moving_shapes", "frame_embed")
#: Identifiers that name a family: ``_WAN_DIMS``, ``MODELOPT_WAN_EXCLUDE``, ``WanFoo``, ``wan_fp8``.
FAMILY_IDENT = re.compile(r"(?i:(?:^|_)(?:wan|hunyuan)(?:_|$|\d))|^(?:Wan|Hunyuan)[A-Z0-9]")
#: Module paths inside one family's transformer, and block-name regexes over them (string constants).
FAMILY_PATH = re.compile(
    r"condition_embedder|time_proj|time_embedder|text_embedder|image_embedder|patch_embedding"
    r"|scale_shift_table|\battn[12]\b|ffn\.net|\bproj_out\b"
    r"|context_embedder|time_text_embed|single_transformer_blocks|transformer_blocks"
    r"|^blocks$|blocks\\\.|blocks\.\d|blocks\.\(|blocks\.\*"
    rf"|^(?:{'|'.join(FAMILY_MODULES)})$|models\.(?:{'|'.join(FAMILY_MODULES)})\b")

#: Stage folders of a run folder (``pipeline.FOLDERS``' values and a pair's ``experts``).
RUN_SUBDIRS = ("export", "calib", "quant", "engine", "parity", "experts")
#: Files a run folder or its stage folders hold at fixed names.
RUN_FILES = ("manifest.json", "report.json", "pipeline.json", "recipe.yaml")
#: Module constants that stand for those names (``pipeline.STATE``, ``manifest.MANIFEST``, ...).
RUN_CONSTANTS = ("FOLDERS", "STATE", "RECIPE_FILE", "MANIFEST", "REPORT_JSON")
#: Modules allowed to know the layout (relative to the package folder) -> what each may join (None: all).
#: ``manifest.py`` is the one manifest writer: the manifest's file name is its own.
LAYOUT_HOMES = {"runfolder.py": None, "manifest.py": ("MANIFEST", "'manifest.json'")}

FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Module:
    name: str          # dotted: trt_sora.calibrate.run
    rel: str           # path relative to the repository: trt_sora/calibrate/run.py
    is_pkg: bool
    tree: ast.Module
    lines: list[str] = field(repr=False)


def load_package(pkg_dir: Path) -> dict[str, Module]:
    """Parse every ``.py`` file under ``pkg_dir`` (a package folder) -> ``{dotted name: Module}``."""
    pkg_dir = Path(pkg_dir).resolve()
    mods = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = path.relative_to(pkg_dir.parent).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        text = path.read_text(encoding="utf-8")
        mods[name] = Module(name, path.relative_to(pkg_dir.parent).as_posix(), is_pkg,
                            ast.parse(text, filename=str(path)), text.splitlines())
    return mods


def _walk(node: ast.AST, scope: tuple[str, ...] = (), in_func: bool = False, guarded: bool = False):
    """Yield ``(node, qualified scope, inside a function, under if TYPE_CHECKING)`` for every node."""
    for child in ast.iter_child_nodes(node):
        yield child, scope, in_func, guarded
        if isinstance(child, (*FUNCS, ast.ClassDef)):
            yield from _walk(child, (*scope, child.name), in_func or isinstance(child, FUNCS), guarded)
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from _walk(child, scope, in_func, True)
        else:
            yield from _walk(child, scope, in_func, guarded)


def longest_functions(mods: dict[str, Module], n: int = 10) -> list[dict]:
    """The ``n`` longest functions and methods: qualified name, file, lines (end - start + 1, decorators out)."""
    rows = [{"name": ".".join((*scope, node.name)), "file": m.rel, "line": node.lineno,
             "lines": node.end_lineno - node.lineno + 1}
            for m in mods.values() for node, scope, _, _ in _walk(m.tree) if isinstance(node, FUNCS)]
    return sorted(rows, key=lambda r: (-r["lines"], r["file"], r["line"]))[:n]


def _resolve(m: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = m.name.split(".") if m.is_pkg else m.name.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_records(mods: dict[str, Module]) -> list[dict]:
    """One record per import statement: where, kind (module / function / type_checking), targets in the package."""
    pkg = next(iter(mods)).split(".")[0] if mods else ""
    out = []
    for m in mods.values():
        for node, _, in_func, guarded in _walk(m.tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            kind = "type_checking" if guarded else "function" if in_func else "module"
            names = [a.name for a in node.names]
            src = _resolve(m, node) if isinstance(node, ast.ImportFrom) else None
            targets = names if src is None else [f"{src}.{a}" if f"{src}.{a}" in mods else src for a in names]
            targets = sorted({t for t in targets if t.split(".")[0] == pkg and t in mods and t != m.name})
            out.append({"module": m.name, "file": m.rel, "line": node.lineno, "kind": kind, "names": names,
                        "source": src, "targets": targets})
    return out


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node (a cycle), each sorted, largest first."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(comps, key=lambda c: (-len(c), c))


def import_cycles(records: list[dict]) -> dict:
    """Edges by kind and the import graph's cycles, counting all runtime imports and module-level ones only."""
    edges = {"module": set(), "function": set()}
    for r in records:
        if r["kind"] in edges:
            edges[r["kind"]].update((r["module"], t) for t in r["targets"])
    result = {"edges": {k: len(v) for k, v in edges.items()}}
    for label, kinds in (("all", ("module", "function")), ("module_level", ("module",))):
        graph: dict[str, set[str]] = {}
        for k in kinds:
            for a, b in edges[k]:
                graph.setdefault(a, set()).add(b)
        comps = strongly_connected(graph)
        result[label] = {"count": len(comps), "components": comps}
    return result


def function_imports(records: list[dict]) -> dict:
    """How many import statements sit inside functions, of all of them (any source, TYPE_CHECKING ones out)."""
    run = [r for r in records if r["kind"] != "type_checking"]
    inside = [r for r in run if r["kind"] == "function"]
    return {"total": len(run), "inside_functions": len(inside),
            "share": round(len(inside) / len(run), 4) if run else 0.0}


def underscore_imports(records: list[dict], pkg: str = "trt_sora") -> list[dict]:
    """``from <package module> import _name``: a private name taken from another module."""
    return [{"file": r["file"], "line": r["line"], "source": r["source"], "name": n}
            for r in records if r["source"] and r["source"].split(".")[0] == pkg
            for n in r["names"] if n.startswith("_") and not n.startswith("__")]


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, *FUNCS)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _hit(m: Module, node: ast.AST, what: str) -> dict:
    return {"file": m.rel, "line": node.lineno, "what": what, "code": m.lines[node.lineno - 1].strip()}


def _family_import(m: Module, node: ast.AST) -> str | None:
    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
        [_resolve(m, node)] + [f"{_resolve(m, node)}.{a.name}" for a in node.names]
    for name in mods:
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "models" and parts[2] in FAMILY_MODULES:
            return f"imports {'.'.join(parts[:3])}"
    return None


def _family_node(m: Module, node: ast.AST, docs: set[int]) -> str | None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return _family_import(m, node)
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
        hit = FAMILY_PATH.search(node.value)
        return f"string names {hit.group(0)!r}" if hit else None
    ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
        node.name if isinstance(node, (*FUNCS, ast.ClassDef)) else None
    return f"identifier {ident}" if ident and FAMILY_IDENT.search(ident) else None


def family_hits(mods: dict[str, Module]) -> list[dict]:
    """Code outside ``<package>/models/`` that names a particular family's module, module path or constant."""
    hits = []
    for m in mods.values():
        if m.name.split(".")[1:2] == ["models"]:
            continue
        docs = _docstrings(m.tree)
        for node in ast.walk(m.tree):
            what = _family_node(m, node, docs) if hasattr(node, "lineno") else None
            if what:
                hits.append(_hit(m, node, what))
    return _dedupe(hits)


def _run_part(node: ast.AST) -> str | None:
    """The run-folder name a path operand spells: a literal stage folder or file, or a layout constant."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        parts = node.value.split("/")
        if parts[0] in RUN_SUBDIRS or parts[-1] in RUN_FILES:
            return repr(node.value)
    if isinstance(node, ast.Subscript):
        return "FOLDERS[...]" if _run_part(node.value) == "FOLDERS" else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return "FOLDERS.get(...)" if _run_part(node.func.value) == "FOLDERS" else None
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name in RUN_CONSTANTS else None


def _joined_parts(node: ast.AST) -> list[str]:
    """What a path join spells: ``a / "export"``, ``os.path.join(a, "calib")``, ``Path(a, "parity")``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return [_run_part(node.right)]
    func = node.func if isinstance(node, ast.Call) else None
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name in ("join", "joinpath", "Path"):
        return [_run_part(a) for a in (node.args[1:] if name == "Path" else node.args)]
    return []


def runfolder_joins(mods: dict[str, Module], pkg_dir: str = "trt_sora") -> list[dict]:
    """Run-folder subpaths joined onto a path (a literal stage folder or file name, or a layout constant)
    and ``FOLDERS[...]`` lookups, outside the modules :data:`LAYOUT_HOMES` lets know them."""
    hits = []
    for m in mods.values():
        home = LAYOUT_HOMES.get(m.rel.removeprefix(f"{pkg_dir}/"), ())
        if home is None:
            continue
        for node in ast.walk(m.tree):
            lookup = _run_part(node) if isinstance(node, (ast.Subscript, ast.Call)) else None
            if lookup and lookup.startswith("FOLDERS"):
                hits.append(_hit(m, node, f"looks up {lookup}"))
            hits += [_hit(m, node, f"joins {p}") for p in _joined_parts(node)
                     if p and not p.startswith("FOLDERS") and p not in home]
    return _dedupe(hits)


def _dedupe(hits: list[dict]) -> list[dict]:
    seen, out = set(), []
    for h in sorted(hits, key=lambda h: (h["file"], h["line"], h["what"])):
        if (h["file"], h["line"], h["what"]) not in seen:
            seen.add((h["file"], h["line"], h["what"]))
            out.append(h)
    return out


def _hits(items: list[dict]) -> dict:
    return {"count": len(items), "lines": len({(h["file"], h["line"]) for h in items}), "items": items}


def analyze(pkg_dir: Path) -> dict:
    """Every measurement of the package folder ``pkg_dir`` as one JSON-ready dict."""
    pkg_dir = Path(pkg_dir)
    mods = load_package(pkg_dir)
    records = import_records(mods)
    init = pkg_dir / "runtime" / "__init__.py"
    fam, joins = family_hits(mods), runfolder_joins(mods, pkg_dir.name)
    under = underscore_imports(records, pkg_dir.name)
    return {
        "package_lines": sum(len(m.lines) for m in mods.values()),
        "runtime_init_lines": len(init.read_text().splitlines()) if init.is_file() else None,
        "longest_functions": longest_functions(mods),
        "cycles": import_cycles(records),
        "function_imports": function_imports(records),
        "underscore_imports": {"count": len(under), "items": under},
        "family_names_outside_models": _hits(fam),
        "runfolder_joins_outside_runfolder": _hits(joins),
    }


def tree_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, keyed by its path relative to it (posix)."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def tensor_hash(path: Path) -> str:
    """sha256 over a safetensors file's tensors (name, dtype, shape, bytes; by name), not its metadata:
    the writer orders metadata keys differently run to run, and calibration stores its wall time there."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    h = hashlib.sha256()
    for name in sorted(k for k in header if k != "__metadata__"):
        t = header[name]
        a, b = t["data_offsets"]
        h.update(json.dumps([name, t["dtype"], t["shape"]]).encode())
        h.update(raw[8 + n + a:8 + n + b])
    return h.hexdigest()


def _agree(runs: list[dict[str, str]]) -> dict[str, str]:
    names = sorted(set().union(*runs))
    return {n: runs[0][n] for n in names if all(n in r for r in runs) and len({r[n] for r in runs}) == 1}


def compare_hashes(folders: list[Path]) -> dict:
    """Hashes of each run folder (files, and safetensors' tensors) and those that agree in all of them."""
    runs = [tree_hashes(f) for f in folders]
    tensors = [{n: tensor_hash(Path(f) / n) for n in r if n.endswith(".safetensors")} for f, r in zip(folders, runs)]
    same = _agree(runs)
    return {"folders": [str(f) for f in folders], "hashes": runs, "tensor_hashes": tensors,
            "deterministic": same, "tensors_deterministic": _agree(tensors),
            "differ": sorted(set().union(*runs) - set(same))}


def check_expected(folder: Path, expected: dict) -> list[str]:
    """Files (and safetensors' tensors) the expected JSON calls deterministic that differ or are missing here."""
    now = compare_hashes([folder])
    return [n for key in ("deterministic", "tensors_deterministic") for n, h in expected[key].items()
            if now[key].get(n) != h]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def print_table(res: dict) -> None:
    c, f = res["cycles"], res["function_imports"]
    print(f"commit {res.get('commit')}  package lines {res['package_lines']}")
    print(f"runtime/__init__.py lines          {res['runtime_init_lines']}")
    print(f"imports inside functions           {f['inside_functions']} / {f['total']} ({f['share']:.1%})")
    print(f"import edges module / function     {c['edges']['module']} / {c['edges']['function']}")
    for label in ("all", "module_level"):
        print(f"cycles ({label})".ljust(35) + str(c[label]["count"]))
        for comp in c[label]["components"]:
            print(f"    {', '.join(comp)}")
    print("longest functions:")
    for r in res["longest_functions"]:
        print(f"    {r['lines']:4d}  {r['name']}  ({r['file']}:{r['line']})")
    for key in ("underscore_imports", "family_names_outside_models", "runfolder_joins_outside_runfolder"):
        print(f"{key}: {res[key]['count']}" + (f" on {res[key]['lines']} lines" if "lines" in res[key] else ""))
        for h in res[key]["items"]:
            where = f"{h['file']}:{h['line']}"
            print(f"    {where}  {h.get('what') or h['source'] + ' import ' + h['name']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--package", type=Path, default=REPO / "trt_sora", help="package folder to measure")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    ap.add_argument("--hashes", type=Path, nargs="+", metavar="DIR",
                    help="hash the files of these run folders instead (several: which files agree)")
    ap.add_argument("--expect", type=Path, help="with --hashes DIR: a hashes JSON whose deterministic files must match")
    ap.add_argument("--note", help="a line stored in the JSON (how the folders were made, why files differ)")
    a = ap.parse_args(argv)
    commit = _git("rev-parse", "HEAD")
    if a.hashes:
        res = {"commit": commit, "note": a.note, **compare_hashes(a.hashes)}
        if a.expect:
            bad = check_expected(a.hashes[0], json.loads(a.expect.read_text()))
            res["changed_vs_expected"] = bad
            print(f"{len(bad)} deterministic files or tensor sets changed" + "".join(f"\n    {b}" for b in bad))
        print(f"{len(res['deterministic'])} files agree, {len(res['differ'])} differ: {', '.join(res['differ'])}")
        print(f"safetensors whose tensors agree: {', '.join(res['tensors_deterministic'])}")
    else:
        res = {"commit": commit, "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
               **analyze(a.package)}
        print_table(res)
    if a.out:
        tmp = a.out.with_name(a.out.name + ".tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        tmp.replace(a.out)
    return 1 if res.get("changed_vs_expected") else 0


if __name__ == "__main__":
    sys.exit(main())
