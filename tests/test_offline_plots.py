"""DVC plots render offline: the HTML template inlines the scripts and declares UTF-8; charts use fitting templates."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("offline_plots", ROOT / "tools" / "offline_plots.py")
offline_plots = importlib.util.module_from_spec(spec)
spec.loader.exec_module(offline_plots)


def test_page_inlines_scripts_without_a_cdn_placeholder():
    page = offline_plots.page(["var vega = {a: 1};", "const b = () => 2;"])
    assert "var vega = {a: 1};" in page and "const b = () => 2;" in page  # braces of the scripts untouched
    assert '<meta charset="utf-8">' in page  # vega's U+2212 minus signs render, no mojibake
    assert "{plot_divs}" in page and "{refresh_tag}" in page
    assert "{scripts}" not in page  # DVC would put its CDN <script src> tags there
    assert "http" not in page


def test_page_refuses_a_script_that_would_end_its_tag():
    with pytest.raises(ValueError, match="</script"):
        offline_plots.page(["x = '</script>'"])


def test_dvc_renders_with_the_template(tmp_path):
    """DVC's own renderer accepts the page as a template (placeholders filled, no CDN tags added)."""
    from dvc_render.html import render_html
    from dvc_render.vega import VegaRenderer

    template = tmp_path / "t.html"
    template.write_text(offline_plots.page(["/* vega */"]), encoding="utf-8")
    renderer = VegaRenderer([{"policy": "sft", "gold_reward": -0.5}], "plots/evaluate.csv",
                            template="bars", template_dir=str(ROOT / ".dvc" / "plots"), x="policy", y="gold_reward")
    out = render_html([renderer], tmp_path / "index.html", html_template=str(template))
    html = Path(out).read_text(encoding="utf-8")
    assert "cdn.jsdelivr" not in html and "vegaEmbed" in html and '"type": "bar"' in html


def test_dvc_yaml_uses_bar_templates_for_categorical_plots():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]

    def props(stage, name):
        return next(entry[name] for entry in stages[stage]["plots"] if isinstance(entry, dict) and name in entry)

    assert props("evaluate", "plots/evaluate.csv")["template"] == "bars"  # a categorical x axis: bars, not a line
    assert props("prepare", "plots/prepare.csv")["template"] == "bars"
    bars = json.loads((ROOT / ".dvc" / "plots" / "bars.json").read_text())
    assert bars["mark"]["type"] == "bar" and bars["encoding"]["y"]["scale"]["zero"] is True


def test_ppo_chart_shows_reward_and_kl():
    top = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    ys = [list(spec["y"].values())[0] for entry in top for spec in entry.values() if "plots/ppo.csv" in spec["y"]]
    assert ["reward_mean", "kl"] in ys
