"""``dvc plots show`` with no network: an HTML template that carries the vega scripts inline.

DVC's default page loads vega, vega-lite and vega-embed from a CDN, so it renders blank offline. This tool
installs those three packages from the npm registry into ``.venv/vega`` (once; never committed) and writes
``.venv/vega/dvc-template.html``: DVC's page with the scripts inlined and a UTF-8 charset (without it vega's
minus signs, U+2212, show as mojibake). ``.dvc/config`` names that template (``plots.html_template``), so a
plain ``dvc plots show`` uses it.

    python tools/offline_plots.py template    # install the scripts if needed and write the template
    python tools/offline_plots.py check       # exit 1 (with the fix) when the template is missing
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VEGA_DIR = ROOT / ".venv" / "vega"
TEMPLATE = VEGA_DIR / "dvc-template.html"
# The majors DVC's renderer targets (its specs use the vega-lite v5 schema).
PACKAGES = {"vega": ("5", "build/vega.min.js"), "vega-lite": ("5", "build/vega-lite.min.js"),
            "vega-embed": ("6", "build/vega-embed.min.js")}

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


def script_paths(vega_dir: Path = VEGA_DIR) -> list[Path]:
    return [vega_dir / "node_modules" / name / rel for name, (_, rel) in PACKAGES.items()]


def install(vega_dir: Path = VEGA_DIR) -> None:
    """``npm install`` the three packages into ``vega_dir`` unless they are there already."""
    if all(p.is_file() for p in script_paths(vega_dir)):
        return
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("offline plots: npm not found; install Node.js (Debian: apt-get install npm) and run again")
    vega_dir.mkdir(parents=True, exist_ok=True)
    specs = [f"{name}@{major}" for name, (major, _) in PACKAGES.items()]
    subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(vega_dir), *specs],
                   check=True)


def page(scripts: list[str]) -> str:
    """DVC's template placeholders (``{plot_divs}``, ``{refresh_tag}``) with ``scripts`` inlined.

    There is deliberately no ``{scripts}`` placeholder: DVC would put its CDN ``<script src>`` tags there.
    """
    for text in scripts:
        if "</script" in text or "{plot_divs}" in text:
            raise ValueError("a vega script contains '</script' or '{plot_divs}': it cannot be inlined safely")
    inline = "\n".join(f"<script type=\"text/javascript\">\n{text}\n</script>" for text in scripts)
    return PAGE.replace("{{", "{").replace("}}", "}").replace("{inline_scripts}", inline)


def write_template(vega_dir: Path = VEGA_DIR, target: Path = TEMPLATE) -> Path:
    install(vega_dir)
    text = page([p.read_text(encoding="utf-8") for p in script_paths(vega_dir)])
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
        print(f"{TEMPLATE.relative_to(ROOT)} is missing: run `make plots` (or python tools/offline_plots.py template)",
              file=sys.stderr)
        return 1
    print(write_template().relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
