"""Rewrites the generated sections of docs/reference.md (the settings and the
metrics tables) from the declarations in the code. `make verify/docs`
(tests/cli/test_docs.py) fails when one is stale."""

import re
from pathlib import Path

from pgoutbox.cli import main as cli
from pgoutbox.core import health, settings

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


def replace(text: str, name: str, table: str) -> str:
    return re.sub(
        rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)",
        lambda m: m.group(1) + table + "\n" + m.group(2),
        text,
        flags=re.S,
    )


text = REFERENCE.read_text()
settings_table = settings.markdown_table(cli.all_settings())
metrics_table = health.metrics_table(cli.all_metrics())
text = replace(text, "settings", settings_table)
text = replace(text, "metrics", metrics_table)
REFERENCE.write_text(text)
print(f"docs/reference.md: {settings_table.count(chr(10)) - 1} settings, {metrics_table.count(chr(10)) - 1} metrics")
