import json

from ft.report import details, md_table, write_json_atomic


def test_md_table_escapes_pipes():
    table = md_table(["a", "b"], [[1, "x|y"]])
    assert table.splitlines() == ["| a | b |", "| --- | --- |", "| 1 | x\\|y |"]


def test_details_wraps_body():
    block = details("stacks", "body")
    assert block.startswith("<details>") and "<summary>stacks</summary>" in block
    assert block.rstrip().endswith("</details>")


def test_write_json_atomic_leaves_no_temp_files(tmp_path):
    target = tmp_path / "sub" / "r.json"
    write_json_atomic(target, {"k": 1})
    assert json.loads(target.read_text()) == {"k": 1}
    assert [p.name for p in target.parent.iterdir()] == ["r.json"]
