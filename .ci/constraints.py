"""CI's constraints file from the environment: every distribution that installing trt_sora with CI's extras
pulls in (the requirement closure of pyproject.toml's core dependencies and those extras, markers evaluated,
read from the installed packages' metadata), pinned at its installed version.

    python .ci/constraints.py              # print the pins
    python .ci/constraints.py --write      # rewrite .ci/constraints.txt (after an upgrade in CI's venv)
    python .ci/constraints.py --check      # exit 1 when .ci/constraints.txt pins more, less or other versions

Run it in a venv made by `make install` (or one holding at least those extras). Extras default to the
Makefile's EXTRAS.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
HEADER = """# CI's exact versions: every distribution `pip install -e '.[{extras}]'` pulls in on the CI
# machines (Python 3.11, CPU torch from local disk). `make install` applies this file with `-c`, so CI
# is reproducible while pyproject.toml keeps ranges for library users. Written by .ci/constraints.py
# from an installed venv (`python .ci/constraints.py --write`); tests/test_dependencies.py checks it
# pins exactly what those extras pull in, and `make install` runs `pip check`.
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def makefile_extras() -> list[str]:
    m = re.search(r"^EXTRAS\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    return m.group(1).split(",")


def closure(extras: list[str]) -> dict[str, str]:
    """``{normalized distribution: installed version}`` that trt_sora with ``extras`` requires, transitively.
    Raises LookupError naming the distributions required but not installed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = norm(project["name"])
    todo: list[tuple[Requirement, frozenset[str]]] = [(Requirement(r), frozenset()) for r in project["dependencies"]]
    optional = project["optional-dependencies"]
    seen_extras: set[str] = set()

    def add_own(names) -> None:
        for e in names:
            if e not in seen_extras:
                seen_extras.add(e)
                todo.extend((Requirement(r), frozenset()) for r in optional[e])

    add_own(extras)
    found: dict[str, str] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    missing: set[str] = set()
    while todo:
        req, _ = todo.pop()
        name = norm(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if name == own:
            add_own(req.extras)
            continue
        key = (name, frozenset(req.extras))
        if key in done:
            continue
        done.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.add(name)
            continue
        found[name] = dist.version.split("+")[0]  # 2.13.0+cpu: `==2.13.0` matches the local build
        for r in dist.requires or []:
            sub = Requirement(r)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}) or any(
                    sub.marker.evaluate({"extra": e}) for e in req.extras):
                todo.append((Requirement(str(sub).split(";")[0]), frozenset()))
    if missing:
        raise LookupError(f"required but not installed: {sorted(missing)}")
    return dict(sorted(found.items()))


def read_pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[norm(name)] = version.strip()
    return pins


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extras", default=",".join(makefile_extras()))
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    pins = closure(args.extras.split(","))
    text = HEADER.format(extras=args.extras) + "".join(f"{n}=={v}\n" for n, v in pins.items())
    if args.check:
        have = read_pins()
        diff = {n: (have.get(n), pins.get(n)) for n in sorted(set(have) | set(pins)) if have.get(n) != pins.get(n)}
        for n, (a, b) in diff.items():
            print(f"{n}: constraints.txt {a or '-'}, installed closure {b or '-'}")
        return 1 if diff else 0
    if args.write:
        CONSTRAINTS.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
