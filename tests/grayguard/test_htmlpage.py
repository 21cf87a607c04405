"""The HTML report building blocks: readable values, tables, links, the Markdown subset, the SVG plots (pure)."""

import re

import pytest

from grayguard.htmlpage import Html, kv_table, label, link, markdown_html, table, value
from grayguard.svgplot import bar_chart, line_chart


@pytest.mark.parametrize("x, want", [
    (None, "–"), (True, "yes"), (0.9018758, "0.902"), (2.0, "2"), (0.0004, "0.0004"), ({"k": 10}, "k=10"),
    ({"timeout": 2, "http_5xx": 1}, "timeout=2, http_5xx=1"), ([], "none"), ({}, "none"),
    (["node2", "node5"], "node2, node5"), ({"p": {"q": None}}, "p=q=–"),
])
def test_values_read_as_text_never_as_a_python_repr(x, want):
    assert value(x) == want


def test_labels_tables_and_links():
    assert label("fault_start_s") == "fault start (s)" and label("entry_weight") == "entry weight"
    t = table(["a", "b"], [[1, "<x>"], [None, Html("<i>y</i>")]], ["faulty", ""])
    assert '<tr class="faulty"><td class="num">1</td><td>&lt;x&gt;</td></tr>' in t and "<td><i>y</i></td>" in t
    assert "<td>–</td>" in t
    assert "false_quarantines" not in kv_table({"false_quarantines": []}) and "<td>none</td>" in kv_table(
        {"false_quarantines": []})
    assert link("https://x.example/runbook.md#a", "runbook") == '<a href="https://x.example/runbook.md#a">runbook</a>'
    assert link("javascript:alert(1)", "runbook") == "runbook"  # only http(s) becomes a link


def test_markdown_subset():
    md = "# T\n\ntext with `code`\nand more\n\n- **PASS** one\n- **MISS** two\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    h = markdown_html(md)
    assert "<h1>T</h1>" in h and "<p>text with <code>code</code> and more</p>" in h
    assert '<li><b class="pass">PASS</b> one</li>' in h and '<b class="miss">MISS</b>' in h
    assert "<table><tr><th>a</th><th>b</th></tr><tr><td>1</td><td>2</td></tr></table>" in h and "---" not in h


def test_line_chart_has_axes_legend_and_breaks_lines_at_none():
    svg = line_chart({"b": [(0, 1.0), (1, None), (2, 3.0), (3, 4.0)], "a": [(0, 2.0), (3, 2.0)]}, title="T",
                     ylabel="seconds", markers=[(1.5, "fault")])
    assert svg.startswith('<svg class="plot"') and "<title>T</title>" in svg
    assert '<g class="axis x">' in svg and '<g class="axis y">' in svg and svg.count('class="axis-label"') == 2
    legend = re.search(r'<g class="legend">(.*?)</g></svg>', svg, re.S)[1]
    assert re.findall(r"<text[^>]*>(\w+)</text>", legend) == ["a", "b"]
    assert svg.count('data-series="b"') == 2 and svg.count('data-series="a"') == 1  # None broke b's line
    assert line_chart({"a": [(0, None)]}, title="T", ylabel="s").startswith('<p class="no-data">')


def test_bar_chart_draws_a_missing_value_as_a_mark_named_in_the_legend():
    svg = bar_chart({"thermal": {"leastconn": None, "grayguard": 3.0}, "hang": {"grayguard": 1.0}}, title="T",
                    ylabel="s", xlabel="fault", series_order=["leastconn", "grayguard"], missing="never detected")
    assert svg.count('data-series="grayguard"') == 2 and 'data-series="leastconn"' not in svg
    assert "thermal, leastconn: never detected" in svg and "× never detected" in svg
    assert '<text class="tick"' in svg and ">thermal<" in svg and ">hang<" in svg
