"""The longest functions of the product (relay/pgoutbox and spark/pgoutbox_spark),
by lines from `def` to the function's last line, decorators excluded.

A function nested in another is counted on its own and inside its parent.
Run from the checkout's root:

    python scripts/longest_functions.py [--most N] [--over LINES]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOTS = ("relay/pgoutbox", "spark/pgoutbox_spark")


def functions(root: Path) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function and method under root."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((lines, f"{path}:{node.lineno} {node.name}"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--most", type=int, default=10, help="how many to list (default 10)")
    parser.add_argument("--over", type=int, default=0, help="count the functions longer than this")
    args = parser.parse_args()
    found = sorted((f for root in ROOTS for f in functions(Path(root))), reverse=True)
    for lines, where in found[: args.most]:
        print(f"{lines:5d}  {where}")
    if args.over:
        print(f"{sum(1 for lines, _ in found if lines > args.over)} of {len(found)} functions over {args.over} lines")


if __name__ == "__main__":
    main()
