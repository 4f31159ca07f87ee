"""The size budget (after tinygrad's sz.py): the largest files and classes of the product code, and a
non-zero exit where a file is over 400 lines or a class over 200.   python tools/size.py [N]"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("fxpar", "passes", "runtime")
MAX_FILE, MAX_CLASS = 400, 200


def measure():
    files, classes = [], []
    for d in DIRS:
        for f in sorted((ROOT / d).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            text = f.read_text()
            files.append((len(text.splitlines()), rel))
            for node in ast.walk(ast.parse(text, filename=rel)):
                if isinstance(node, ast.ClassDef):
                    classes.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
    return sorted(files, reverse=True), sorted(classes, reverse=True)


def main(top: int = 10) -> int:
    files, classes = measure()
    over = []
    for kind, plural, rows, limit in (("file", "files", files, MAX_FILE), ("class", "classes", classes, MAX_CLASS)):
        print(f"{'lines':>6}  largest {plural} (budget {limit})")
        for n, name in rows[:top]:
            print(f"{n:6d}  {name}{'  OVER' if n > limit else ''}")
        over += [f"{kind} {name}: {n} lines > {limit}" for n, name in rows if n > limit]
    print(f"{sum(n for n, _ in files):6d}  total in {', '.join(d + '/' for d in DIRS)} ({len(files)} files)")
    for line in over:
        print(f"size: {line}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(*map(int, sys.argv[1:2])))
