"""``dvc plots show`` with no network: an HTML template that carries the vega scripts inline.

DVC's default page loads vega, vega-lite and vega-embed from a CDN, so it renders blank offline. The Python
package ``vl-convert-python`` (the Vega project's own, a pinned dependency) ships those three libraries as one
self-contained script (``vl_convert.javascript_bundle``); this tool writes ``.venv/vega/dvc-template.html``:
DVC's page with that script inlined and a UTF-8 charset (without it vega's minus signs, U+2212, show as
mojibake). ``make setup`` runs it, and ``.dvc/config`` names that template (``plots.html_template``), so a plain
``.venv/bin/dvc plots show`` works offline as typed.

    python tools/offline_plots.py template    # write the template (no network, no npm)
    python tools/offline_plots.py check       # exit 1 (with the fix) when the template is missing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VEGA_DIR = ROOT / ".venv" / "vega"
TEMPLATE = VEGA_DIR / "dvc-template.html"
VEGA_LITE = "5.21"
"""The vega-lite major DVC's renderer targets (its specs use the v5 schema); the newest 5.x vl-convert bundles."""

PAGE = """<!DOCTYPE html>
<html>
<head>
  <meta charset="utf-8">
  {refresh_tag}
  <title>RLHF pipeline: DVC plots</title>
  {inline_scripts}
  <style>
    body {{ font-family: sans-serif; }}
    table {{ border-spacing: 15px; }}
  </style>
</head>
<body>
  {plot_divs}
</body>
</html>
"""


def bundled_scripts() -> list[str]:
    """vega, vega-lite and vega-embed as one script that defines ``vega``, ``vegaLite`` and ``vegaEmbed``."""
    import vl_convert

    return [vl_convert.javascript_bundle(vl_version=VEGA_LITE)]


def page(scripts: list[str]) -> str:
    """DVC's template placeholders (``{plot_divs}``, ``{refresh_tag}``) with ``scripts`` inlined.

    There is deliberately no ``{scripts}`` placeholder: DVC would put its CDN ``<script src>`` tags there.
    """
    for text in scripts:
        if "</script" in text or "{plot_divs}" in text:
            raise ValueError("a vega script contains '</script' or '{plot_divs}': it cannot be inlined safely")
    inline = "\n".join(f"<script type=\"text/javascript\">\n{text}\n</script>" for text in scripts)
    return PAGE.replace("{{", "{").replace("}}", "}").replace("{inline_scripts}", inline)


def write_template(target: Path = TEMPLATE) -> Path:
    """Write the template atomically (a half-written page would break ``dvc plots show``)."""
    text = page(bundled_scripts())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("template", "check"))
    args = parser.parse_args(argv)
    if args.command == "check":
        if TEMPLATE.is_file():
            return 0
        print(f"{TEMPLATE.relative_to(ROOT)} is missing: run `make setup` (or python tools/offline_plots.py template)",
              file=sys.stderr)
        return 1
    print(write_template().relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
