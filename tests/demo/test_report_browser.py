"""The demo's HTML reports as a person sees them: opened in headless Chromium, they render without console errors,
show no raw `{'` structure, and every plot has its axes and legend. The checker must also catch a broken page."""


import pytest

from grayguard.demo import cli
from tests.support import demo_inputs
from tests.support.browser import check_pages, problems

pytestmark = pytest.mark.browser

BROKEN = """<!doctype html><html><head><title>broken</title></head><body><p>parameters {'k': 10}</p>
<svg class="plot"><title>no legend</title><g class="axis x"><text class="tick">0</text><text class="tick">1</text>
<text class="axis-label">s</text></g><g class="series"><polyline points="0,0 1,1"/></g></svg>
<script>notDefined()</script></body></html>"""


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """Every demo page (the --compare report and its three runs, the membership report) and a broken one, checked
    in one Chromium."""
    d = tmp_path_factory.mktemp("reports")
    cli.compare(cli.DemoOptions(), d / "compare", run=demo_inputs.run)
    demo_inputs.membership(d / "membership")
    (d / "broken.html").write_text(BROKEN)
    pages = [d / "compare" / p / "report.html" for p in ("", "with-controller", "without-controller", "healthy")]
    return check_pages([*pages, d / "membership" / "report.html", d / "broken.html"])


def test_every_demo_report_reads_well_in_a_browser(checked):
    good = {p: found for p, found in checked.items() if p.name != "broken.html"}
    assert len(good) == 5
    assert all(not found for found in good.values()), {str(p): f for p, f in good.items() if f}


def test_the_checker_flags_a_broken_page(checked):
    found = next(f for p, f in checked.items() if p.name == "broken.html")
    assert any(f.startswith("console: ReferenceError: notDefined is not defined") for f in found), found
    assert any(f.startswith("raw structure in the text") and "{'k': 10}" in f for f in found), found
    assert "plot 'no legend': no legend" in found and "plot 'no legend': no y axis label" in found


@pytest.mark.parametrize("change, want", [
    ({"errors": ["boom"]}, "console: boom"),
    ({"text": "false quarantines []"}, "raw structure in the text"),
    ({"plots": [{"name": "p", "x_label": ["s"], "y_label": ["w"], "x_ticks": 5, "y_ticks": 5, "legend": ["a"],
                 "legend_shown": False, "data": 1}]}, "plot 'p': legend not rendered"),
    ({"plots": [{"name": "p", "x_label": [], "y_label": ["w"], "x_ticks": 5, "y_ticks": 5, "legend": ["a"],
                 "legend_shown": True, "data": 0}]}, "plot 'p': no x axis label"),
])
def test_problems_of_what_the_browser_saw(change, want):
    seen = {"title": "t", "text": "fine", "plots": [], "errors": [], **change}
    assert any(f.startswith(want) for f in problems(seen))
    assert problems({"title": "t", "text": "fine", "plots": [], "errors": []}) == []
