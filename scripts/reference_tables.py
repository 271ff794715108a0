"""Rewrites the generated section of docs/reference.md (the settings table)
from the setting declarations. `make verify/docs` (tests/cli/test_docs.py)
fails when it is stale."""

import re
from pathlib import Path

from pgoutbox.cli import main as cli
from pgoutbox.core import settings

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"

text = REFERENCE.read_text()
table = settings.markdown_table(cli.all_settings())
text = re.sub(
    r"(<!-- settings:begin -->\n).*?(<!-- settings:end -->)",
    lambda m: m.group(1) + table + "\n" + m.group(2),
    text,
    flags=re.S,
)
REFERENCE.write_text(text)
print(f"docs/reference.md settings table: {table.count(chr(10)) - 1} settings")
