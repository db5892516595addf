"""The review page over HTTP (a real server on 127.0.0.1 and a stand-in for the served policy that writes traces as
the served policy does): the reviewer's name, ratings and side-by-side choices recorded as MLflow assessments, text
escaped, no script allowed, forms of other sites refused, a failure shown to the reviewer."""

from __future__ import annotations

import http.cookiejar
import json
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

SCRIPT = "<script>document.title='pwned'</script>"


@pytest.fixture()
def store(tmp_path, monkeypatch):
    """An MLflow store with the project's experiment active; returns (client, experiment id)."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = mlflow.set_experiment("rlhf-pipeline").experiment_id
    return mlflow.MlflowClient(), experiment


def _serve(server: ThreadingHTTPServer) -> str:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


class FakePolicy(BaseHTTPRequestHandler):
    """Stands in for ``make serve-model``: answers /invocations with a fixed completion per alias, traced as the served
    policy traces (tasks.serving.answer.traced_generation); there is no challenger alias unless ``challenger`` is set."""

    completions = {"champion": " was great" + SCRIPT, "challenger": " was dull."}

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        from tasks.serving.answer import LoadedVersion, trace_tags, traced_generation

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        alias = body["params"]["model_alias"]
        if alias not in self.completions:  # as tasks/serving/alias_server.py answers while an alias is unset
            from tasks.serving.answer import ALIAS_MISSING

            data = json.dumps({"error_code": "TEMPORARILY_UNAVAILABLE",
                               "message": f"rlhf-policy@{alias}: {ALIAS_MISSING}"}).encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        prompt = body["inputs"][0]
        loaded = LoadedVersion("1" if alias == "champion" else "2", None, "dpo", None, None)
        completion, trace_id = traced_generation(prompt, 8, 0, lambda *_: self.completions[alias],
                                                 trace_tags("rlhf-policy", loaded, alias))
        data = json.dumps({"predictions": [{"completion": completion, "trace_id": trace_id}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def page(store):
    from tasks.feedback.review_page import ReviewSettings, make_server

    client, experiment = store
    policy = ThreadingHTTPServer(("127.0.0.1", 0), FakePolicy)
    settings = ReviewSettings(client, experiment, _serve(policy), "http://127.0.0.1:5000")
    server = make_server(settings, port=0)
    url = _serve(server)
    yield url, settings
    server.shutdown()
    policy.shutdown()


class Browser:
    """Cookies kept, redirects followed: what a browser does with the page's forms."""

    def __init__(self, url: str):
        self.url = url
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))

    def get(self, path: str = "/") -> str:
        with self.opener.open(self.url + path, timeout=30) as response:
            return response.read().decode()

    def post(self, path: str, **fields) -> str:
        data = urllib.parse.urlencode(fields).encode()
        with self.opener.open(self.url + path, data=data, timeout=30) as response:
            return response.read().decode()


def _token(html: str) -> str:
    return re.search(r'name=token value="([^"]+)"', html).group(1)


def test_the_page_asks_who_judges_and_records_it_with_each_judgement(page, store):
    from tasks.serving.answer import LoadedVersion, trace_tags, traced_generation

    url, settings = page
    client, _ = store
    answer = traced_generation(f"I think {SCRIPT}", 8, 0, lambda *_: " it was <b>bold</b>.",
                               trace_tags("rlhf-policy", LoadedVersion("1", None, "dpo", None, None), "champion"))[1]
    browser = Browser(url)
    first = browser.get()
    assert "Your name" in first
    with pytest.raises(urllib.error.HTTPError) as no_name:
        browser.post("/reviewer", token=_token(first), reviewer="  ")
    assert no_name.value.code == 400 and "a name is needed" in no_name.value.read().decode()
    home = browser.post("/reviewer", token=_token(first), reviewer="Alice <i>")
    assert "Reviewing as <b class=reviewer>Alice &lt;i&gt;</b>" in home
    assert f"I think {SCRIPT}" not in home and "I think &lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in home
    assert "it was &lt;b&gt;bold&lt;/b&gt;." in home  # the answer shown as text
    done = browser.post("/rate", token=_token(home), trace=answer, good="false")
    assert "Recorded: bad." in done and answer not in done  # rated: no longer listed for this reviewer
    (rating,) = client.get_trace(answer).info.assessments
    assert (rating.name, rating.value, rating.source.source_type, rating.source.source_id) == (
        "good", False, "HUMAN", "Alice <i>")


def test_a_side_by_side_choice_is_one_preference_on_both_traces(page, store):
    url, settings = page
    client, _ = store
    browser = Browser(url)
    browser.post("/reviewer", token=settings.token, reviewer="bob")
    pair = browser.post("/compare", token=settings.token, prompt="The film")
    ids = re.findall(r'name=chosen value="([^"]+)"', pair)
    assert len(ids) == 2 and pair.count('<pre class=completion>') == 2
    assert SCRIPT not in pair and "&lt;script&gt;" in pair  # the champion's answer holds a script: shown as text
    assert "model_version" not in pair and not re.search(r">v[12] ", pair)  # blind: the versions are not shown
    texts = {i: client.get_trace(i).data.spans[0].outputs["completion"] for i in ids}
    chosen = next(i for i, text in texts.items() if text == " was dull.")  # B or A: the order is random
    rejected = next(i for i in ids if i != chosen)
    assert "Recorded your choice" in browser.post("/prefer", token=settings.token, chosen=chosen, rejected=rejected)
    (on_chosen,) = client.get_trace(chosen).info.assessments
    assert (on_chosen.name, on_chosen.value, on_chosen.source.source_id) == ("preferred", True, "bob")
    assert on_chosen.metadata == {"rejected_trace_id": rejected}
    (on_rejected,) = client.get_trace(rejected).info.assessments
    assert on_rejected.value is False and on_rejected.metadata["chosen_trace_id"] == chosen


def test_without_a_challenger_the_pair_is_two_samples_of_the_champion(page, monkeypatch, store):
    monkeypatch.setattr(FakePolicy, "completions", {"champion": " was fine."})
    url, settings = page
    client, _ = store
    browser = Browser(url)
    browser.post("/reviewer", token=settings.token, reviewer="bob")
    ids = re.findall(r'name=chosen value="([^"]+)"', browser.post("/compare", token=settings.token, prompt="It"))
    assert {client.get_trace(i).info.tags["rlhf.model_alias"] for i in ids} == {"champion"}


def test_every_response_forbids_scripts(page):
    url, _ = page
    with urllib.request.urlopen(url + "/", timeout=30) as response:
        policy = response.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src" not in policy  # no script source is allowed at all


def test_a_form_without_this_servers_token_is_refused_and_writes_nothing(page, store):
    url, settings = page
    client, experiment = store
    browser = Browser(url)
    browser.post("/reviewer", token=settings.token, reviewer="mallory")
    with pytest.raises(urllib.error.HTTPError) as refused:
        browser.post("/compare", token="forged", prompt="The film")
    assert refused.value.code == 403
    assert not client.search_traces(experiment_ids=[experiment])  # nothing generated, nothing judged


def test_a_judgement_that_cannot_be_recorded_says_so(page, store):
    url, settings = page
    browser = Browser(url)
    browser.post("/reviewer", token=settings.token, reviewer="carol")
    shown = browser.post("/rate", token=settings.token, trace="tr-does-not-exist", good="true")
    assert "your rating was NOT recorded" in shown and "no such trace" in shown


def test_an_answer_the_intake_could_not_train_on_is_refused_when_judged_not_at_collection(page, store, monkeypatch):
    from tasks.feedback.assessments import JudgementError, record_rating
    from tasks.serving.answer import LoadedVersion, trace_tags, traced_generation

    url, settings = page
    client, experiment = store
    tags = trace_tags("rlhf-policy", LoadedVersion("1", None, "dpo", None, None), "champion")
    nul = traced_generation("The film", 8, 0, lambda *_: " was \x00 odd", tags)[1]  # a byte a tiny policy can emit
    empty = traced_generation("The film", 8, 0, lambda *_: "  ", tags)[1]
    browser = Browser(url)
    home = browser.post("/reviewer", token=settings.token, reviewer="erin")
    assert nul not in home and empty not in home and "2 recent answer(s) not listed" in home
    shown = browser.post("/rate", token=settings.token, trace=nul, good="true")
    assert "your rating was NOT recorded" in shown and "contains a NUL character" in shown
    with pytest.raises(JudgementError, match="field 'completion' is empty"):
        record_rating(client, empty, True, "erin", experiment_id=experiment)
    assert not client.get_trace(nul).info.assessments and not client.get_trace(empty).info.assessments
    monkeypatch.setattr(FakePolicy, "completions", {"champion": " \x00"})  # a pair holding one: asked again
    shown = browser.post("/compare", token=settings.token, prompt="It")
    assert "<h1>Which answer is better?</h1>" not in shown  # not the pair page: home, with the reason
    assert "cannot be a training row" in shown and "ask again" in shown


def test_trace_link_opens_the_trace_in_mlflows_trace_view():
    from tasks.feedback.review_page import ReviewSettings, trace_link

    settings = ReviewSettings(client=None, experiment_id="7", model_url="http://127.0.0.1:5001",
                              mlflow_ui_url="http://127.0.0.1:5000/")
    url = urllib.parse.urlsplit(trace_link(settings, "tr-abc"))
    path, _, query = url.fragment.partition("?")
    assert (url.netloc, path) == ("127.0.0.1:5000", "/experiments/7/traces")
    # the query MLflow 3.17's own UI builds for a trace link (its bundle: URLSearchParams({selectedEvaluationId: id,
    # traceId: id})); with it Chromium opened the trace view (the screenshot in docs/lifecycle.md, section 6)
    assert urllib.parse.parse_qs(query) == {"selectedEvaluationId": ["tr-abc"], "traceId": ["tr-abc"]}


@pytest.mark.parametrize("length, status", [("-1", 400), ("abc", 400), (None, 411), ("70000", 413)])
def test_a_form_of_no_or_a_bad_length_is_refused_before_its_body_is_read(page, length, status):
    """``Content-Length: -1`` once made the page read everything the client sent (64 MiB past the 64 KiB cap)."""
    import socket

    url, _ = page
    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    header = f"Content-Length: {length}\r\n" if length is not None else ""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(f"POST /rate HTTP/1.1\r\nHost: x\r\n{header}\r\ntoken=x".encode())  # the body never ends
        reply = sock.recv(4096).decode("latin-1")
    assert reply.startswith(f"HTTP/1.0 {status}") or reply.startswith(f"HTTP/1.1 {status}"), reply[:200]
