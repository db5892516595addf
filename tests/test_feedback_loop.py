"""Slow, end to end, as a team would run it: the champion served (``python -m flows.serve_model``), requests answered
with a trace each, a reviewer judging in a real headless browser on the review page (``python -m flows.review``),
another through MLflow's API, the judgements collected (``python -m flows.collect_feedback``: intake, DVC, git, then
the retrain), the gate's decision followed by the served model, and the new version's lineage back to the traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _browser import Browser, chromium_path
from _launch import free_port
from _pipeline_project import make_project, mlflow_client
from test_registry_serve import _stop

from flows.serve import wait_http
from rlhf_core.feedback import read_manifest, read_stored_rows

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NAME = "rlhf-policy"
# KTO alone: one policy keeps the run short, and every rating the reviewers give reaches it (tasks/feedback/lineage.py)
OVERRIDES = {"ppo.enabled": False, "dpo.enabled": False, "grpo.enabled": False, "rloo.enabled": False,
             "registry.candidates": ["kto"], "registry.min_improvement": 0.0, "registry.significance": 1.0}
LIKED, DISLIKED = "This movie was wonderful, I loved it and", "This movie was awful, boring and"
SCRIPT = "<script>document.title='pwned'</script>"


def _python(args: list[str], root: Path, timeout: int = 900) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    out = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out.stdout


def _start(args: list[str], root: Path, log: Path, health: str) -> subprocess.Popen:
    """A server of the project in its own process group; returns once ``health`` answers 200."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, *args], cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        wait_http(health, 180, process, log)
    except (RuntimeError, TimeoutError) as error:
        _stop(process)
        pytest.fail(f"{' '.join(args)}: {error}:\n{log.read_text()[-4000:]}")
    return process


def _ask(url: str, prompt: str) -> dict:
    body = json.dumps({"inputs": [prompt], "params": {"max_new_tokens": 12}}).encode()
    request = urllib.request.Request(f"{url}/invocations", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["predictions"][0]


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def _review_in_the_browser(browser: Browser, page: str, judge, shots: Path) -> None:
    """A reviewer named Alice: checks the script in a prompt is shown as text, rates every listed answer whose
    sentiment is clear (good when the gold judge says positive), then compares two answers and picks the better."""
    browser.goto(page)
    browser.value("document.querySelector('input[name=reviewer]').value = 'Alice'")
    browser.submit("document.querySelector('form[action=\"/reviewer\"] button').click()")
    assert browser.value("document.querySelector('.reviewer').innerText") == "Alice"
    assert browser.value("document.title") == "Review the served policy"  # the served script did not run
    assert SCRIPT in browser.value("document.body.innerText")  # it is displayed, as text
    assert browser.value("document.querySelectorAll('script').length") == 0
    browser.screenshot(shots / "review-page.png")
    rated = 0
    while True:
        cards = browser.value("[...document.querySelectorAll('.card')].map(c => [c.querySelector('.prompt')"
                              ".innerText, c.querySelector('.completion').innerText])")
        choices = [(i, judge(p + c)) for i, (p, c) in enumerate(cards) if abs(judge(p + c)) >= 0.2]
        if not choices:
            break
        index, score = choices[0]
        button = "true" if score > 0 else "false"
        browser.submit(f"document.querySelectorAll('.card')[{index}].querySelector('button[value=\"{button}\"]').click()")
        assert "Recorded:" in browser.value("document.querySelector('.notice').innerText")
        rated += 1
    assert rated >= 2
    for _ in range(5):  # the tiny policy may answer with nothing or a NUL: the page refuses such a pair, asking again
        browser.value(f"document.querySelector('textarea[name=prompt]').value = {json.dumps(LIKED)}")
        browser.submit("document.querySelector('form[action=\"/compare\"] button').click()")
        if browser.value("document.title") == "Which answer is better?":
            break
        assert "cannot be a training row" in browser.value("document.querySelector('.error').innerText")
    browser.screenshot(shots / "review-pair.png")
    answers = browser.value("[...document.querySelectorAll('.side pre')].map(p => p.innerText)")
    better = max(range(2), key=lambda i: judge(LIKED + answers[i]))
    browser.submit(f"document.querySelectorAll('.side button')[{better}].click()")
    assert "Recorded your choice" in browser.value("document.querySelector('.notice').innerText")


@pytest.mark.skipif(chromium_path() is None, reason="no chromium on this machine: the review page needs a browser")
def test_served_answers_judged_in_a_browser_teach_the_next_version(tmp_path, monkeypatch):
    import mlflow
    from mlflow.entities import AssessmentSource, AssessmentSourceType

    from rlhf_core.rewards import GoldJudge
    from tasks.feedback.assessments import Generation
    from tasks.feedback.lineage import LINEAGE_FILE

    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RLHF_PARENT_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    root = make_project(tmp_path / "proj", OVERRIDES)
    _python(["-m", "flows.retrain", "--root", str(root)], root)  # v1, the champion; its record lands on main
    client = mlflow_client(root)
    champion = str(client.get_model_version_by_alias(NAME, "champion").version)

    model_url, page_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    served = _start(["-m", "flows.serve_model", "--root", str(root), "--port", model_url.rsplit(":", 1)[1],
                     "--reload-s", "1"], root, tmp_path / "serve.log", f"{model_url}/ping")
    review = _start(["-m", "flows.review", "--root", str(root), "--port", page_url.rsplit(":", 1)[1], "--model-url",
                     model_url], root, tmp_path / "review.log", f"{page_url}/health")
    browser = Browser(tmp_path / "chromium-profile")
    judge = lambda text: GoldJudge()([text])[0]  # noqa: E731 - the project's gold judge: what "better" means here
    try:
        answers = [_ask(model_url, p) for p in (LIKED, DISLIKED, LIKED, DISLIKED, f"{SCRIPT} The film was")]
        assert {a["model_version"] for a in answers} == {champion}
        for a in answers:  # every answer is a trace of the project's experiment, tagged with its version
            assert client.get_trace(a["trace_id"]).info.tags["rlhf.model_version"] == champion
        _review_in_the_browser(browser, page_url + "/", judge, tmp_path)

        dave = _ask(model_url, DISLIKED + " dull")  # another reviewer, through MLflow's own API
        for _ in range(10):  # the tiny policy may answer EOS at once or a NUL byte: the intake refuses such a row
            if Generation(dave["trace_id"], DISLIKED + " dull", dave["completion"], "").training_refusal() is None:
                break
            dave = _ask(model_url, DISLIKED + " dull")
        mlflow.log_feedback(trace_id=dave["trace_id"], name="good", value=judge(DISLIKED + " dull" + dave["completion"]) > 0,
                            source=AssessmentSource(source_type=AssessmentSourceType.HUMAN, source_id="dave"))

        head = _git(root, "rev-parse", "HEAD")
        out = _python(["-m", "flows.collect_feedback", "--root", str(root)], root)  # make intake-feedback
        assert "ingested ratings batch" in out and "ingested pairs batch" in out and "Recorded on retrain/" in out

        # the record of the retrain landed on main; nothing is left to run
        assert _git(root, "rev-list", "--count", f"{head}..HEAD") == "2"  # the intake commit, the retrain record
        assert "Retrained-branch: main" in _git(root, "log", "-1", "--format=%B")
        latest = max(client.search_model_versions(f"name='{NAME}'"), key=lambda v: int(v.version))
        assert int(latest.version) > int(champion) and latest.tags["policy"] == "kto"
        assert latest.tags["decision"] in ("promote", "keep")  # the gate decided (its reason: the tag `reason`)
        now = str(client.get_model_version_by_alias(NAME, "champion").version)
        assert now == (str(latest.version) if latest.tags["decision"] == "promote" else champion)
        time.sleep(1.5)  # the served model looks the alias up again at most every second
        assert _ask(model_url, LIKED)["model_version"] == now  # the service follows the gate without a restart
        if now == champion:  # the gate kept the champion: a promotion by hand is followed the same way
            client.set_registered_model_alias(NAME, "champion", latest.version)
            time.sleep(1.5)
            assert _ask(model_url, LIKED)["model_version"] == str(latest.version)

        # version -> batch -> traces and judgements
        store = root / "incoming"
        ratings = [r for r in read_manifest(store) if r["kind"] == "ratings"]
        assert latest.tags["feedback.batches"] == ",".join(r["sha256"] for r in ratings)
        lineage = json.loads(Path(mlflow.artifacts.download_artifacts(run_id=latest.run_id,
                                                                      artifact_path=LINEAGE_FILE)).read_text())
        judged = [j for b in lineage["batches"] for j in b["judgements"]]
        assert {j["reviewer"] for j in judged} == {"Alice", "dave"}, (dave, out)  # `out` lists refusals and why
        rows = read_stored_rows(store, [r["file"] for r in ratings])
        assert sorted(j["assessment_id"] for j in judged) == sorted(r["assessment_id"] for r in rows)
        for j in judged:
            (assessment,) = [a for a in client.get_trace(j["trace_id"]).info.assessments
                             if a.assessment_id == j["assessment_id"]]
            assert assessment.source.source_id == j["reviewer"] and assessment.name == "good"
        (pair,) = read_stored_rows(store, [r["file"] for r in read_manifest(store) if r["kind"] == "pairs"])
        assert pair["reviewer"] == "Alice" and pair["prompt"] == LIKED

        again = _python(["-m", "flows.collect_feedback", "--root", str(root), "--no-retrain"], root)
        assert "no new judgements" in again and _git(root, "rev-list", "--count", f"{head}..HEAD") == "2"
    finally:
        browser.close()
        _stop(review)
        _stop(served)
