"""Token heat maps: each token coloured by its contribution to the explained logit.

Red for positive contributions, blue for negative, the colour's strength ``|C| / max|C|``
over the row's shown tokens; each row states the explained logit and the sum of the
contributions, which equal each other. Three renderings of the same map: a
self-contained HTML page (:func:`heatmap_html`), ANSI colours for a terminal
(:func:`heatmap_ansi`) and a PNG (:func:`heatmap_png`).
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .atomic_file import write_atomically

__all__ = ["heatmap_html", "heatmap_ansi", "heatmap_png", "save_html"]

_POSITIVE = (214, 39, 40)
_NEGATIVE = (31, 119, 180)
_SHOWN = {"\n": "↵", "\t": "→", "\r": "␍"}


@dataclass
class _Row:
    tokens: list[str]
    values: list[float]
    logit: float | None
    label: str | None

    @property
    def scale(self) -> float:
        return max((abs(v) for v in self.values), default=0.0) or 1.0


def _rows(tokens: Sequence, contribution: torch.Tensor | Sequence[torch.Tensor],
          logit: torch.Tensor | Sequence[float] | float | None, mask: torch.Tensor | Sequence[torch.Tensor] | None,
          labels: Sequence[str] | None) -> list[_Row]:
    """Check the arguments and split them into one row per sequence, padding dropped."""
    if isinstance(contribution, torch.Tensor):
        if contribution.dim() not in (1, 2):
            raise ValueError(f"contribution must have shape (T,) or (B, T), got {tuple(contribution.shape)}")
        single = contribution.dim() == 1
        values = list(contribution.detach().reshape(1, -1) if single else contribution.detach())
    elif isinstance(contribution, Sequence) and all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in contribution):
        single, values = False, list(contribution)
    else:
        raise TypeError("contribution must be a tensor (T,) or (B, T), or a list of (T,) tensors; got "
                        f"{type(contribution).__name__}")
    values = [v.double().cpu() for v in values]
    if not all(bool(torch.isfinite(v).all()) for v in values):
        raise ValueError("contribution holds NaN or Inf")
    batch = len(values)
    per_row = [list(tokens)] if single else [list(row) for row in tokens]
    if len(per_row) != batch or any(len(row) != len(v) for row, v in zip(per_row, values)):
        raise ValueError(f"tokens must be one string per contribution: rows of {[len(v) for v in values][:8]} "
                         f"contributions, of {[len(row) for row in per_row][:8]} tokens")
    if any(not isinstance(token, str) for row in per_row for token in row):
        raise TypeError("tokens must be strings (tokenizer.convert_ids_to_tokens or a decode per id)")
    logits = [None] * batch if logit is None else \
        torch.as_tensor(logit, dtype=torch.float64).detach().cpu().reshape(-1).tolist()
    if len(logits) != batch:
        raise ValueError(f"logit must have one value per row ({batch}), got {len(logits)}")
    if mask is None:
        keep = [torch.ones(len(v), dtype=torch.bool) for v in values]
    else:
        keep = [torch.as_tensor(m).detach().cpu().bool() for m in (mask.reshape(batch, -1) if isinstance(
            mask, torch.Tensor) else mask)]
        if len(keep) != batch or any(k.shape != v.shape for k, v in zip(keep, values)):
            raise ValueError("mask must have the contributions' shape")
    labels = [None] * batch if labels is None else list(labels)
    if len(labels) != batch:
        raise ValueError(f"labels must have one entry per row ({batch}), got {len(labels)}")
    return [_Row([t for t, k in zip(per_row[b], keep[b]) if k], values[b][keep[b]].tolist(), logits[b],
                 None if labels[b] is None else str(labels[b])) for b in range(batch)]


def _colour(value: float, scale: float) -> tuple[int, int, int]:
    """White blended toward red (positive) or blue (negative) by ``|value| / scale``."""
    strength = min(abs(value) / scale, 1.0)
    tint = _POSITIVE if value >= 0 else _NEGATIVE
    return tuple(round(255 + (c - 255) * strength) for c in tint)


def _caption(row: _Row) -> str:
    parts = [] if row.label is None else [f"explained: {row.label}"]
    if row.logit is not None:
        parts.append(f"logit {row.logit:.6g}")
    parts.append(f"Σ contributions {math.fsum(row.values):.6g}")
    return " · ".join(parts)


def _readable(token: str) -> str:
    return "".join(_SHOWN.get(ch, ch) for ch in token)


def heatmap_html(tokens: Sequence, contribution: torch.Tensor | Sequence[torch.Tensor],
                 logit: torch.Tensor | Sequence[float] | float | None = None, *, mask: object = None, labels: Sequence[str] | None = None,
                 title: str = "OMENN token contributions") -> str:
    """A self-contained HTML page (no scripts, no external files) of the token heat map.

    Args:
        tokens: the tokens as strings, (T,) or one list per sequence (B, T).
        contribution: ``Explanation.contribution`` (T,) or (B, T), or a list of (T,)
            tensors (sequences of different lengths).
        logit: the explained logit per sequence (``Explanation.logit``), shown with the sum.
        mask: the attention mask, (B, T) or one (T,) per sequence; padding (0) is not shown.
        labels: what each sequence's logit explains (e.g. the predicted token), shown.
        title: the page's title.

    Each token's exact contribution is its tooltip. Tokens are HTML-escaped.
    """
    rows = _rows(tokens, contribution, logit, mask, labels)
    body = []
    for row in rows:
        spans = "".join(
            f'<span class="t" style="background:rgb{_colour(v, row.scale)}" title="{v:.6g}">'
            f"{html.escape(_readable(t))}</span>" for t, v in zip(row.tokens, row.values))
        body.append(f'<div class="row"><div class="caption">{html.escape(_caption(row))}</div>'
                    f'<div class="tokens">{spans}</div></div>')
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
.row {{ margin-bottom: 1.2em; }}
.caption {{ color: #444; font-size: 0.9em; margin-bottom: 0.3em; }}
.tokens {{ font-family: monospace; font-size: 1.05em; line-height: 1.9; }}
.t {{ white-space: pre; padding: 0.1em 0; border-radius: 2px; }}
.legend {{ color: #666; font-size: 0.85em; }}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p class="legend">Red: the token raises the logit; blue: it lowers it; colour strength |C| / max |C| of the row.
Hover a token for its contribution. The contributions of a row sum to its logit.</p>
{chr(10).join(body)}
</body>
</html>
"""


def save_html(path: str | os.PathLike[str], page: str) -> Path:
    """Write ``page`` to ``path`` atomically (a partial file never replaces an existing one)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give the HTML file's path")
    return write_atomically(path, lambda temporary: temporary.write_text(page, encoding="utf-8"))


def heatmap_ansi(tokens: Sequence, contribution: torch.Tensor | Sequence[torch.Tensor],
                 logit: torch.Tensor | Sequence[float] | float | None = None, *, mask: object = None, labels: Sequence[str] | None = None) -> str:
    """The token heat map for a terminal: 24-bit ANSI background colours, one caption and one
    line of tokens per sequence (arguments as :func:`heatmap_html`)."""
    lines = []
    for row in _rows(tokens, contribution, logit, mask, labels):
        lines.append(_caption(row))
        lines.append("".join("\x1b[48;2;{};{};{}m\x1b[38;2;0;0;0m".format(*_colour(v, row.scale)) + _readable(t)
                             + "\x1b[0m" for t, v in zip(row.tokens, row.values)))
    return "\n".join(lines)


def heatmap_png(path: str | os.PathLike[str], tokens: Sequence, contribution: torch.Tensor | Sequence[torch.Tensor],
                logit: torch.Tensor | Sequence[float] | float | None = None, *, mask: object = None,
                labels: Sequence[str] | None = None, width: int = 72, dpi: int = 150) -> Path:
    """The token heat map as a PNG image, lines wrapped at ``width`` characters (arguments as
    :func:`heatmap_html`); written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = _rows(tokens, contribution, logit, mask, labels)
    lines: list[tuple[str, list[tuple[str, float, float]]]] = []  # per line: caption or tokens with scale
    for row in rows:
        lines.append((_caption(row), []))
        current, used = [], 0
        for token, value in zip(row.tokens, row.values):
            text = _readable(token)
            if current and used + len(text) > width:
                lines.append(("", current))
                current, used = [], 0
            current.append((text, value, row.scale))
            used += len(text)
        lines.append(("", current))
    # Monospace advance per character and the box's padding, as fractions of the font size.
    size, char, pad = 11, 0.602, 0.15
    line_height = 1.9 * size
    fig = Figure(figsize=((width * (char + 2 * pad) * size + 2 * size) / 72, (len(lines) * line_height + size) / 72), dpi=dpi)
    FigureCanvasAgg(fig)
    height = fig.get_figheight() * 72
    for i, (caption, pieces) in enumerate(lines):
        y = 1 - (i + 1) * line_height / height
        if caption:
            fig.text(size / (fig.get_figwidth() * 72), y, caption, fontsize=size * 0.85, color="#444",
                     family="sans-serif", va="bottom")
            continue
        x = size
        for text, value, scale in pieces:
            left = x / (fig.get_figwidth() * 72)
            fig.text(left, y, text, fontsize=size, family="monospace", va="bottom",
                     bbox={"boxstyle": f"square,pad={pad}", "facecolor": [c / 255 for c in _colour(value, scale)],
                           "edgecolor": "none"})
            x += (len(text) * char + 2 * pad) * size
    return write_atomically(Path(path), lambda temporary: fig.savefig(temporary, dpi=dpi, format="png"))
