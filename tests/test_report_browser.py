"""The scaling report in a real headless Chromium: it fits a 1300-px window and works offline.

Chromium's headless mode is driven from the command line only (no WebDriver): `--dump-dom`
prints the DOM after the page loaded, so a copy of the report with a measuring script appended
writes what the browser laid out into an attribute; `--screenshot` saves what a user would see.
Flags: https://developer.chrome.com/docs/chromium/headless (`--dump-dom`, `--screenshot`,
`--window-size`, `--virtual-time-budget`); `--host-resolver-rules` makes every host name
unresolvable, so an external asset could not load.
"""

from __future__ import annotations

import html as htmllib
import json
import re
import shutil
import struct
import subprocess

import pytest
from PIL import Image

from tests.test_analysis_report import FABRIC, write_run, write_study
from vitpod.analysis import report, scaling

WIDTH = 1300  # the browser width users reported the cut-off column at
CHROMIUM = next((p for n in ("chromium", "chromium-browser") if (p := shutil.which(n))), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (apt-get install chromium; scripts/setup.sh does)",
)
FLAGS = [
    "--headless",
    "--no-sandbox",  # the tests run as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: nothing outside the file can load
    "--virtual-time-budget=5000",  # let the load event (images decoded) happen before the dump
]
# Appended to a copy of the report: after load, record the viewport, the document's scroll
# width, each table's box and each image's decoded size, and their rectangles on the page.
MEASURE = """<script>
window.addEventListener("load", () => {
  const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.right]; };
  const rect = (e) => {
    const r = e.getBoundingClientRect(), y = window.scrollY;
    return [r.left, r.top + y, r.right, r.bottom + y];
  };
  const m = {inner: window.innerWidth, doc: document.documentElement.scrollWidth,
             tables: {}, lastHeader: {}, images: [], rects: {}, lastHeaderRect: {},
             imageRects: []};
  for (const t of document.querySelectorAll("table")) {
    m.tables[t.id] = box(t);
    m.rects[t.id] = rect(t);
    const ths = t.querySelectorAll("th");
    m.lastHeader[t.id] = box(ths[ths.length - 1]);
    m.lastHeaderRect[t.id] = rect(ths[ths.length - 1]);
  }
  for (const i of document.images) {
    m.images.push([i.complete, i.naturalWidth, box(i)[1]]);
    m.imageRects.push(rect(i));
  }
  document.body.setAttribute("data-measure", JSON.stringify(m));
});
</script>
"""


@pytest.fixture
def study_with_long_failure(tmp_path):
    """Three good points and one failed point whose run directory is a long unbroken path (a
    failed row prints it, and an unbreakable string is what widens a table)."""
    root = tmp_path / "study"
    write_run(root / "g1", 1, 32, 100.0, [0.0])
    write_run(root / "g2", 2, 16, 180.0, [0.010, 0.030])
    write_run(root / "g4", 4, 8, 320.0, [0.020, 0.020, 0.040, 0.040])
    long_name = "g8-" + "x" * 180
    write_run(root / long_name, 8, 4, 500.0, [0.05] * 8, summary=False)
    points = [{"gpus": 1, "run_dir": "g1"}, {"gpus": 2, "run_dir": "g2"}]
    points += [{"gpus": 4, "nodes": 2, "run_dir": "g4"}]
    points += [{"gpus": 8, "nodes": 4, "run_dir": long_name}]
    return write_study(root, "strong", points, FABRIC, 4e6)


def chromium(*args: str) -> str:
    assert CHROMIUM is not None
    out = subprocess.run(
        [CHROMIUM, *FLAGS, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def measure(html_path, tmp_path) -> dict:
    probe = tmp_path / "measure.html"
    probe.write_text(html_path.read_text() + MEASURE)
    dom = chromium(f"--window-size={WIDTH},900", "--dump-dom", probe.as_uri())
    found = re.search(r'data-measure="([^"]*)"', dom)
    assert found, "the measuring script did not run: " + dom[-500:]
    return json.loads(htmllib.unescape(found[1]))


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_report_fits_a_1300px_window_offline(study_with_long_failure, tmp_path):
    html_path = report.write_report(scaling.load_study(study_with_long_failure))
    text = html_path.read_text()
    assert not re.search(r'(src|href)="(?!data:|#)', text), "external asset in the report"
    m = measure(html_path, tmp_path)
    assert m["inner"] == WIDTH
    # No horizontal scrollbar: the document is no wider than the window, and every table
    # (its last header cell included) ends inside it.
    assert m["doc"] <= WIDTH, m
    assert set(m["tables"]) == {
        "throughput",
        "breakdown",
        "prediction",
        "goodput",
        "stragglers",
        "references",
    }
    for name, (left, right) in m["tables"].items():
        assert 0 <= left and right <= WIDTH, (name, m["tables"])
        assert m["lastHeader"][name][1] <= right, (name, m["lastHeader"])
    # Every plot decoded with the network unreachable (data: URIs) and lies inside the window.
    assert len(m["images"]) == 4
    for complete, natural_width, right in m["images"]:
        assert complete and natural_width > 0 and right <= WIDTH, m["images"]


def test_report_screenshot_shows_the_whole_table(study_with_long_failure, tmp_path):
    html_path = report.write_report(scaling.load_study(study_with_long_failure))
    m = measure(html_path, tmp_path)
    shot = tmp_path / "report.png"
    chromium(f"--window-size={WIDTH},2400", f"--screenshot={shot}", html_path.as_uri())
    assert png_size(shot) == (WIDTH, 2400)
    # Both number tables end inside the captured width, so the screenshot shows every column.
    assert m["doc"] <= WIDTH and {"throughput", "breakdown"} <= set(m["tables"]), m
    assert max(right for _, right in m["tables"].values()) <= WIDTH
    # And the pixels show them: text (dark pixels) in each table and in its last header cell,
    # and every plot drawn (not one flat colour) where the DOM laid it out.
    pixels = Image.open(shot).convert("L")
    for name in ("throughput", "breakdown"):
        assert dark_pixels(pixels, m["rects"][name]) > 500, (name, m["rects"][name])
        assert dark_pixels(pixels, m["lastHeaderRect"][name]) > 20, (name, "last header")
    plots = [r for r in m["imageRects"] if r[3] <= 2400]
    assert plots, m["imageRects"]
    for box in plots:
        low, high = pixels.crop(tuple(round(v) for v in box)).getextrema()
        assert high - low > 100, ("a blank plot", box)
    assert dark_pixels(pixels, [0, 0, WIDTH, 2400]) < 0.5 * WIDTH * 2400, "a dark page"


def dark_pixels(image: Image.Image, box: list[float]) -> int:
    """How many pixels of the box are darker than mid-grey (text, lines)."""
    region = image.crop(tuple(round(v) for v in box))
    return sum(region.point(lambda v: 255 if v < 128 else 0).histogram()[255:])
