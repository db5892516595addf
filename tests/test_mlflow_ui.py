"""``make mlflow-ui``: the bare MLflow root opens the training ("Model training") view, not MLflow 3's GenAI view."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"host": "127.0.0.1:5000"}  # MLflow's host check admits loopback names only


@pytest.fixture(scope="module")
def client():
    from starlette.testclient import TestClient

    from tasks.serving.training_view import app

    with TestClient(app()) as test_client:
        yield test_client


def _bundle(page: str) -> str:
    """The text of MLflow's main script that ``page`` (its index.html) loads."""
    import mlflow.server

    src = re.search(r'src="(static-files/static/js/main\.[0-9a-f]+\.js)"', page).group(1)
    return (Path(mlflow.server.__file__).parent / "js" / "build" / src.removeprefix("static-files/")).read_text()


def test_the_bare_root_stores_the_training_view_before_mlflows_script_reads_it(client):
    """Issue 33: the bare root (make mlflow-ui's URL) opened the GenAI view in a browser that had never chosen one:
    MLflow's script reads the view from localStorage, default genai. The page now stores the training view first,
    unless the browser chose; MLflow's own script must still read that key, in that format (an upgrade that renames
    it fails here)."""
    from tasks.serving.training_view import SCRIPT, TRAINING_VIEW, VIEW_KEY

    page = client.get("/", headers=LOCAL)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert int(page.headers["content-length"]) == len(page.content)
    html = page.text
    assert SCRIPT.decode() in html and html.index(SCRIPT.decode()) < html.index("<script defer")
    assert f'localStorage.getItem("{VIEW_KEY}")===null' in html  # a reviewer's own choice is kept
    bundle = _bundle(html)
    key, version = VIEW_KEY.rsplit("_v", 1)
    assert f'key:"{key}",version:{version},' in bundle and "`${e}_v${t}`" in bundle  # MLflow's key and its format
    assert f'MACHINE_LEARNING="{TRAINING_VIEW}"' in bundle and "JSON.parse" in bundle
    cached = client.get("/", headers={**LOCAL, "if-none-match": page.headers.get("etag", '"x"'),
                                      "if-modified-since": page.headers.get("last-modified", "")})
    assert cached.status_code == 200 and SCRIPT.decode() in cached.text  # never a 304 to an unchanged cached page


def test_every_other_request_is_mlflows_own(client):
    from tasks.serving.training_view import SCRIPT

    assert client.get("/health", headers=LOCAL).text == "OK"
    icon = client.get("/static-files/favicon.ico", headers=LOCAL)
    assert icon.status_code == 200 and SCRIPT not in icon.content
    assert client.get("/", headers={"host": "evil.example:5000"}).status_code == 403  # MLflow's host check still holds


def test_make_mlflow_ui_serves_that_app():
    from flows.ui import ui_command
    from tasks.serving import training_view

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["mlflow.app"]
    module, name = declared[training_view.APP_NAME].split(":")
    assert (module, name) == (training_view.__name__, "app") and callable(training_view.app)
    command = ui_command("sqlite:///mlflow.db", 5123)
    assert command[0] == str(Path(sys.prefix) / "bin" / "mlflow") and command[1] == "ui"
    assert command[command.index("--app-name") + 1] == training_view.APP_NAME
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "--app-name" not in ui_command("sqlite:///mlflow.db", 5123, training_view=False)  # a venv from before it
