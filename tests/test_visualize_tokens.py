"""Token heat maps: the HTML page is valid and self-contained with every token escaped, the ANSI
map colours each token, the PNG is written atomically, and bad arguments are named."""

from __future__ import annotations

import html.parser
import re

import pytest
import torch

from omenn_kernels.visualize_tokens import heatmap_ansi, heatmap_html, heatmap_png, save_html

TOKENS = [["<s>", " a & b", ' "quoted"', "\n"], ["<pad>", "x", "<script>alert(1)</script>", " y"]]
CONTRIBUTION = torch.tensor([[0.5, -1.0, 2.0, 0.25], [0.0, 1.5, -0.5, 0.75]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])


class _Checked(html.parser.HTMLParser):
    """Records tags and text, and fails on an end tag that closes no open element."""

    VOID = {"meta", "br"}

    def __init__(self) -> None:
        super().__init__()
        self.open, self.tags, self.spans = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in self.VOID:
            self.open.append(tag)
        if tag == "span":
            self.spans.append(dict(attrs))

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, (tag, self.open)
        self.open.pop()


def test_the_html_page_is_valid_self_contained_and_escapes_tokens():
    page = heatmap_html(TOKENS, CONTRIBUTION, CONTRIBUTION.sum(1), mask=MASK, labels=["token 5", "<b>"])
    parser = _Checked()
    parser.feed(page)
    parser.close()
    assert parser.open == []
    assert "script" not in parser.tags and "b" not in parser.tags  # the tokens and labels stayed text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and " a &amp; b" in page and "&lt;b&gt;" in page
    assert not re.search(r"(src|href)=", page)  # nothing loaded from elsewhere
    assert len(parser.spans) == 7  # the padding token is not shown
    assert [float(span["title"]) for span in parser.spans] == [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 0.75]
    colours = [span["style"] for span in parser.spans]
    assert colours[2] == "background:rgb(214, 39, 40)"  # the row's largest, fully red
    assert colours[1] == "background:rgb(143, 187, 218)"  # half of it, negative: half-way to blue
    assert "logit 1.75 · Σ contributions 1.75" in page and "↵" in page


def test_the_ansi_map_colours_each_shown_token():
    text = heatmap_ansi(TOKENS[1], CONTRIBUTION[1], 1.75, mask=MASK[1])
    caption, line = text.split("\n")
    assert caption == "logit 1.75 · Σ contributions 1.75"
    assert line.count("\x1b[48;2;") == 3 and "<pad>" not in line
    assert "\x1b[48;2;214;39;40m\x1b[38;2;0;0;0mx\x1b[0m" in line


def test_the_png_and_html_are_written_whole(tmp_path, monkeypatch):
    path = heatmap_png(tmp_path / "map.png", TOKENS, CONTRIBUTION, mask=MASK)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = tmp_path / "map.html"
    page.write_text("kept")
    with pytest.raises(RuntimeError, match="disk full"):
        monkeypatch.setattr("pathlib.Path.write_text", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("disk full")))
        save_html(page, "new")
    monkeypatch.undo()
    assert page.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["map.html", "map.png"]
    with pytest.raises(IsADirectoryError, match="is a folder"):
        save_html(tmp_path, "new")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"rows of \[4, 4\] contributions, of \[4, 3\] tokens"):
        heatmap_html([TOKENS[0], TOKENS[1][:3]], CONTRIBUTION)
    with pytest.raises(ValueError, match="NaN or Inf"):
        heatmap_html(TOKENS, CONTRIBUTION * float("nan"))
    with pytest.raises(ValueError, match=r"one value per row \(2\), got 3"):
        heatmap_ansi(TOKENS, CONTRIBUTION, torch.zeros(3))
    with pytest.raises(TypeError, match="tokens must be strings"):
        heatmap_ansi([[1, 2, 3, 4]] * 2, CONTRIBUTION)
