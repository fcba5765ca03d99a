"""tests/fidelity/table.py: the fork table's measured section is made from the suite's JSON
alone, and only the text between its markers changes."""

from __future__ import annotations

import json

from tests.fidelity import table


def _outcome(word: str, detail: str = "") -> dict:
    return {"outcome": word, "detail": detail}


HOST = {"kernel": "6.18", "module": False, "victims": {
    "pipe": {"title": "pipes with bytes", "ws_fork": {"child": _outcome("FAIL", "pipe size: 1\nbytes: 2"),
                                                       "source": _outcome("PASS"), "same_tasks": True},
             "tpl_fork": {"child": _outcome("FAIL", "pipe size: 1\nbytes: 2"), "source": _outcome("PASS"),
                          "same_tasks": False},
             "criu": {"child": _outcome("PASS"), "source": _outcome("PASS"), "same_tasks": True}},
    "setuid": {"title": "another uid", "ws_fork": {"child": _outcome("REFUSED", "fd socket:[123] uid"),
                                                   "source": _outcome("PASS"), "same_tasks": True},
               "tpl_fork": {"child": _outcome("REFUSED", "fd socket:[456] uid"), "source": _outcome("PASS"),
                            "same_tasks": True}},
}}
GUEST = {"kernel": "6.1", "module": True, "victims": {
    "pipe": {"title": "pipes with bytes", "ws_fork": {"child": _outcome("PASS")},
             "tpl_fork": {"child": _outcome("PASS")}}}}


def test_a_row_per_class_and_a_note_per_distinct_difference():
    text = table.section(HOST, GUEST)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert rows == [
        "| pipes with bytes (`pipe.c`) | ws.fork: PASS; tpl.fork: PASS (new tasks) | FAIL [1] | PASS | PASS |",
        "| another uid (`setuid.c`) | PASS | REFUSED [2] | not run | not run |",
    ]
    assert "1. pipe size: 1; bytes: 2\n2. fd socket:[…] uid\n" in text


def test_only_the_marked_section_changes(tmp_path, monkeypatch):
    doc = tmp_path / "fork-table.md"
    doc.write_text(f"# head\n{table.BEGIN}\nold\n{table.END}\n## tail\n")
    monkeypatch.setattr(table, "TABLE", doc)
    results = tmp_path / "r.json"
    results.write_text(json.dumps(HOST))
    assert table.main([str(results)]) == 0
    head, rest = doc.read_text().split(table.BEGIN)
    body, tail = rest.split(table.END)
    assert head == "# head\n" and tail == "\n## tail\n" and "old" not in body and "not run" in body
