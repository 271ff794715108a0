"""Rewrites the generated README section (the settings table) from the code.
`make verify/readme` (tests/cli/test_readme.py) fails when it is stale."""

import re
from pathlib import Path

from pgoutbox.cli import main as cli
from pgoutbox.core import settings

README = Path(__file__).resolve().parent.parent / "README.md"

text = README.read_text()
table = settings.markdown_table(cli.all_settings())
text = re.sub(
    r"(<!-- settings:begin -->\n).*?(<!-- settings:end -->)",
    lambda m: m.group(1) + table + "\n" + m.group(2),
    text,
    flags=re.S,
)
README.write_text(text)
print(f"README settings table: {table.count(chr(10)) - 1} settings")
