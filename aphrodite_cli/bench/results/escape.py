"""Text a benchmark target sent (error bodies, error codes, model ids), made safe to print and
to write: a target is a stranger, and its words must never drive the user's terminal (title,
clear-screen or clipboard escape sequences), rich's markup, a Markdown summary or an HTML
report.

- :func:`printable`: every control or format character (C0, DEL, C1 such as the 8-bit CSI,
  bidirectional overrides, zero-width characters, line and paragraph separators) written as
  its Python escape (``\\x1b``, ``\\u202e``), so it shows and does nothing; optionally cut to
  a length with a visible mark. Result files hold target text in this form.
- :func:`rich_safe`: printable, then rich's markup escaped (``[/code]`` prints as it is).
- :func:`markdown_safe`: printable, then Markdown's and HTML's active characters escaped
  (a table cell stays one cell, no link, emphasis, heading or raw HTML).
- :func:`html_safe`: printable, then HTML-escaped.
"""

from __future__ import annotations

import html
import re
import unicodedata

#: Unicode categories that print nothing visible and may act: controls, formats (bidi
#: overrides, zero-width), unassigned/private code points, line and paragraph separators
_ACTIVE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
#: what makes Markdown act mid-line: code, emphasis, links, tables, raw HTML, entities
_MARKDOWN = re.compile(r"([\\`*_\[\]|<>~&])")


def _escape_char(ch: str) -> str:
    if unicodedata.category(ch) not in _ACTIVE:
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else (f"\\u{code:04x}" if code < 0x10000
                                                   else f"\\U{code:08x}")


def printable(text: object, limit: int | None = None) -> str:
    """``text`` (anything: a target may send a number or a list where a string belongs) with
    every control and format character written as its escape; cut to ``limit`` characters
    (after escaping) with `` [cut: N chars]`` (N: the original's length) when longer."""
    if not isinstance(text, str):
        text = str(text)
    if limit is None:
        return "".join(_escape_char(ch) for ch in text)
    safe = "".join(_escape_char(ch) for ch in text[: limit + 1])
    if len(text) > limit or len(safe) > limit:
        return safe[:limit] + f" [cut: {len(text)} chars]"
    return safe


def rich_safe(text: object, limit: int | None = None) -> str:
    """For a rich string printed with markup on."""
    from rich.markup import escape

    return escape(printable(text, limit))


def markdown_safe(text: object, limit: int | None = None) -> str:
    """For Markdown (a table cell or a line of prose in ``summary.md``)."""
    return _MARKDOWN.sub(r"\\\1", printable(text, limit))


def html_safe(text: object, limit: int | None = None) -> str:
    return html.escape(printable(text, limit), quote=True)
