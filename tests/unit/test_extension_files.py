"""What needs no server of the extension's support: the restore list of a
plain dump (tests/install/test_extension.py builds, installs and runs the
extension's scripts)."""

from __future__ import annotations

from pgoutbox.core import migrate as m


def test_restore_list_leaves_a_plain_dump_alone():
    toc = "; Archive\n3553; 2606 16674 CONSTRAINT outbox events_p20261124 events_p20261124_pkey postgres\n"
    toc += "3605; 0 0 INDEX ATTACH outbox events_p20261124_pkey postgres\n"
    assert m.restore_list(toc) == (toc, 0)
    extension = "2; 3079 16385 EXTENSION - pgoutbox \n" + toc
    out, skipped = m.restore_list(extension)
    assert skipped == 2 and out.count("\n;3") == 2
