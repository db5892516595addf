"""The review page: reviewers judge served generations in a browser (``make review``, http://127.0.0.1:5002).

A small page served by the standard library's ``http.server`` on 127.0.0.1, in plain HTML forms: no JavaScript, no
CDN, nothing to build or update. It asks for the reviewer's name once (a cookie; recorded as the source id of every
judgement), then offers

- **which answer is better?** A prompt (the newest served one, or the reviewer's own) is sent to the served policy
  twice, ``champion`` and ``challenger`` (two samples of the champion when there is no other challenger); the two
  answers are shown side by side in random order, without their versions; the choice is recorded as a preference
  (``tasks/feedback/assessments.py``). The texts shown are read back from the traces, never from the form;
- **rate answers**: the newest served generations this reviewer has not rated yet, each with Good and Bad buttons
  and a link to its trace in MLflow's UI (where it can be rated too).

Everything a model or a reviewer wrote is HTML-escaped before it is shown, and every response carries a
Content-Security-Policy that allows no script at all: a response containing ``<script>`` is displayed, never run.
Every form carries a token of this server's run (a page of another site cannot post a judgement), and a judgement
that cannot be recorded says why, so the reviewer can retry it: nothing entered is dropped silently.
"""

from __future__ import annotations

import html
import json
import random
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from tasks.process.logs import get_logger
from tasks.feedback.assessments import (JudgementError, Generation, check_reviewer, load_generation, recent_generations,
                          record_preference, record_rating, RATING)
from tasks.serving.answer import ALIAS_MISSING, MAX_PROMPT_CHARS

COOKIE = "rlhf_reviewer"
NOTICES = {"pair": "Recorded your choice. Thank you!", "good": "Recorded: good.", "bad": "Recorded: bad."}
"""What the page says after a judgement was recorded (``/?done=<key>``: fixed texts, nothing taken from the URL)."""
MAX_BODY = 64 * 1024
"""Largest form body accepted (a prompt is at most ``MAX_PROMPT_CHARS`` characters)."""
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:1.5em auto;padding:0 1em;color:#222}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:.6em;border-radius:4px;margin:.3em 0}
.pair{display:flex;gap:1em}.side{flex:1;border:1px solid #ccc;border-radius:6px;padding:.6em}
.card{border:1px solid #ddd;border-radius:6px;padding:.6em;margin:.6em 0}.meta{color:#666;font-size:.85em}
.notice{background:#e8f4e8;padding:.5em;border-radius:4px}.error{background:#fbe9e9;padding:.5em;border-radius:4px}
button{font-size:1em;padding:.3em .9em;margin-right:.4em}textarea{width:100%;font-size:1em}"""


def esc(text) -> str:
    """``text`` safe inside HTML text and quoted attributes."""
    return html.escape(str(text), quote=True)


@dataclass
class ReviewSettings:
    """Where the page reads and writes."""

    client: object
    """An ``MlflowClient`` of the project's store (``mlflow`` pointed at the same store)."""
    experiment_id: str
    model_url: str
    """The served policy (``make serve-model``), e.g. http://127.0.0.1:5001."""
    mlflow_ui_url: str
    """MLflow's UI, for the links to a trace (``make mlflow-ui``)."""
    token: str = ""
    """The forms' token of this server's run (set by :func:`make_server`)."""
    listed: int = 10
    """How many unrated generations the page lists."""


# --------------------------------------------------------------------------------------------
# HTML (pure: settings and data in, a page out)
# --------------------------------------------------------------------------------------------


def page(title: str, body: str) -> str:
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{esc(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def _token_field(token: str) -> str:
    return f'<input type=hidden name=token value="{esc(token)}">'


def name_form(token: str, error: str = "") -> str:
    problem = f'<p class=error>{esc(error)}</p>' if error else ""
    return page("Review: who are you?", f"""<h1>Review the served policy</h1>{problem}
<form method=post action=/reviewer>{_token_field(token)}
<label>Your name (recorded with every judgement you make): <input name=reviewer maxlength=64 autofocus></label>
<button type=submit>Start</button></form>""")


def trace_link(settings: ReviewSettings, trace_id: str) -> str:
    """The trace in MLflow's UI, opened in its trace view (the query MLflow 3.17's own "View trace" links use)."""
    base = settings.mlflow_ui_url.rstrip("/")
    query = urlencode({"selectedEvaluationId": trace_id, "traceId": trace_id})
    return f"{base}/#/experiments/{quote(settings.experiment_id)}/traces?{query}"


def home(settings: ReviewSettings, reviewer: str, unrated: list[Generation], last_prompt: str,
         notice: str = "", error: str = "", untrainable: int = 0) -> str:
    """The reviewer's page: the side-by-side form, then the generations to rate (``untrainable``: how many recent
    answers are left out because no judgement of them could be trained on)."""
    token = _token_field(settings.token)
    flash = (f'<p class=notice>{esc(notice)}</p>' if notice else "") + (f'<p class=error>{esc(error)}</p>' if error else "")
    cards = "".join(f"""<div class=card><div class=meta>prompt</div><pre class=prompt>{esc(g.prompt)}</pre>
<div class=meta>answer</div><pre class=completion>{esc(g.completion)}</pre>
<form method=post action=/rate>{token}<input type=hidden name=trace value="{esc(g.trace_id)}">
<button type=submit name=good value=true>Good</button><button type=submit name=good value=false>Bad</button>
<span class=meta>v{esc(g.model_version)} · <a href="{esc(trace_link(settings, g.trace_id))}">trace {esc(g.trace_id)}
</a></span></form></div>""" for g in unrated) or "<p>Nothing left to rate: every recent answer has your rating.</p>"
    if untrainable:
        cards += (f"<p class=meta>{untrainable} recent answer(s) not listed: empty, or with a NUL character, "
                  "they could not be training rows.</p>")
    return page("Review the served policy", f"""<h1>Review the served policy</h1>
<p>Reviewing as <b class=reviewer>{esc(reviewer)}</b> · <a href=/change>not you?</a></p>{flash}
<h2>Which answer is better?</h2>
<form method=post action=/compare>{token}<textarea name=prompt rows=2 maxlength={MAX_PROMPT_CHARS}>{esc(last_prompt)}</textarea>
<button type=submit>Ask for two answers</button></form>
<h2>Rate answers</h2>{cards}""")


def pair_view(settings: ReviewSettings, reviewer: str, a: Generation, b: Generation) -> str:
    """The side-by-side choice: one prompt, two answers (A and B, versions hidden), a button under each."""
    token = _token_field(settings.token)

    def side(label: str, shown: Generation, other: Generation) -> str:
        return f"""<div class=side><h3>{label}</h3><pre class=completion>{esc(shown.completion)}</pre>
<form method=post action=/prefer>{token}<input type=hidden name=chosen value="{esc(shown.trace_id)}">
<input type=hidden name=rejected value="{esc(other.trace_id)}"><button type=submit>{label} is better</button></form></div>"""

    return page("Which answer is better?", f"""<h1>Which answer is better?</h1>
<p>Reviewing as <b class=reviewer>{esc(reviewer)}</b></p><div class=meta>prompt</div><pre class=prompt>{esc(a.prompt)}</pre>
<div class=pair>{side("A", a, b)}{side("B", b, a)}</div><p><a href=/>Skip this pair</a></p>""")


# --------------------------------------------------------------------------------------------
# what the forms do
# --------------------------------------------------------------------------------------------


def ask_pair(model_url: str, prompt: str, timeout: float = 120.0) -> tuple[str, str]:
    """Ask the served policy for the champion's and the challenger's answer to ``prompt`` (a second champion sample
    when there is no challenger); returns their trace ids in random order (the reviewer sees A and B, not which)."""
    first = _ask(model_url, prompt, "champion", timeout)
    try:
        second = _ask(model_url, prompt, "challenger", timeout)
    except urllib.error.HTTPError as error:
        if not _alias_missing(error):  # no challenger alias: two samples of the champion
            raise
        second = _ask(model_url, prompt, "champion", timeout)
    pair = [first["trace_id"], second["trace_id"]]
    random.SystemRandom().shuffle(pair)
    return pair[0], pair[1]


def _alias_missing(error: urllib.error.HTTPError) -> bool:
    """The served policy's answer while an alias is unset (503 naming it; ``tasks/serving/alias_server.py``)."""
    try:
        return error.code == HTTPStatus.SERVICE_UNAVAILABLE and ALIAS_MISSING in json.loads(error.read())["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return False


def _ask(model_url: str, prompt: str, alias: str, timeout: float) -> dict:
    body = json.dumps({"inputs": [prompt], "params": {"model_alias": alias}}).encode()
    request = urllib.request.Request(f"{model_url.rstrip('/')}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())["predictions"][0]


def form_length(raw: str | None) -> int | tuple[int, str]:
    """The byte count of a posted form from its ``Content-Length``, or (HTTP status, reason) refusing it: absent
    (411), not a non-negative integer (400: ``-1`` would make ``read`` take everything), over :data:`MAX_BODY` (413)."""
    if raw is None:
        return HTTPStatus.LENGTH_REQUIRED, "Content-Length is required."
    if not raw.strip().isdigit():
        return HTTPStatus.BAD_REQUEST, f"Content-Length: {raw[:20]!r} is not a byte count."
    if int(raw) > MAX_BODY:
        return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"That form is too large (limit {MAX_BODY} bytes)."
    return int(raw)


class ReviewHandler(BaseHTTPRequestHandler):
    """Routes: GET / (the reviewer's page), GET /pair?a=&b= (a side-by-side choice), GET /change (forget the
    name), GET /health; POST /reviewer, /compare, /prefer, /rate (forms with the run's token)."""

    settings: ReviewSettings  # set on the subclass made by make_server
    server_version = "rlhf-review"
    sys_version = ""

    # -- plumbing ------------------------------------------------------------------------------

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        get_logger().debug("review page: " + format, *args)

    def _send(self, status: int, body: str = "", headers: dict[str, str] | None = None) -> None:
        data = body.encode("utf-8")
        self.send_response(status)
        for key, value in {**SECURITY_HEADERS, "Content-Type": "text/html; charset=utf-8",
                           "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _redirect(self, location: str, headers: dict[str, str] | None = None) -> None:
        self._send(HTTPStatus.SEE_OTHER, "", {"Location": location, **(headers or {})})

    def _reviewer(self) -> str | None:
        cookie = SimpleCookie(self.headers.get("Cookie", ""))
        try:
            return check_reviewer(unquote(cookie[COOKIE].value)) if COOKIE in cookie else None
        except JudgementError:
            return None

    def _form(self) -> dict[str, str] | None:
        """The posted form when it is one of this server's (its token), else None (answered 403 already)."""
        length = form_length(self.headers.get("Content-Length"))
        if isinstance(length, tuple):
            self._send(length[0], page("Refused", f"<p>{esc(length[1])}</p>"), {"Connection": "close"})
            self.close_connection = True  # a body of unknown length is never read
            return None
        fields = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode("utf-8", "replace")).items()}
        if not secrets.compare_digest(fields.get("token", ""), self.settings.token):
            self._send(HTTPStatus.FORBIDDEN, page("Refused", "<p>This form is not from this review page (or the "
                                                              "page was restarted): <a href=/>reload it</a>.</p>"))
            return None
        return fields

    # -- routes --------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/health":
            return self._send(HTTPStatus.OK, "ok", {"Content-Type": "text/plain; charset=utf-8"})
        if url.path == "/change":
            return self._redirect("/", {"Set-Cookie": f"{COOKIE}=; Max-Age=0; Path=/; SameSite=Strict"})
        reviewer = self._reviewer()
        if url.path not in ("/", "/pair"):
            return self._send(HTTPStatus.NOT_FOUND, page("Not found", "<p>No such page. <a href=/>Back</a></p>"))
        if reviewer is None:
            return self._send(HTTPStatus.OK, name_form(self.settings.token))
        if url.path == "/pair":
            return self._pair(reviewer, query.get("a", ""), query.get("b", ""))
        return self._home(reviewer, NOTICES.get(query.get("done", ""), ""))

    def do_POST(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        actions = {"/compare": self._compare, "/prefer": self._prefer, "/rate": self._rate}
        if url.path not in (*actions, "/reviewer"):
            return self._send(HTTPStatus.NOT_FOUND, page("Not found", "<p>No such form.</p>"))
        fields = self._form()
        if fields is None:
            return None
        if url.path == "/reviewer":
            return self._set_reviewer(fields)
        reviewer = self._reviewer()
        if reviewer is None:
            return self._redirect("/")
        return actions[url.path](fields, reviewer)

    def _home(self, reviewer: str, notice: str = "", error: str = "") -> None:
        s = self.settings
        recent = recent_generations(s.client, s.experiment_id, limit=max(50, s.listed))
        unrated = [g for g in recent if not g.judged_by(reviewer, RATING)]
        trainable = [g for g in unrated if g.training_refusal() is None]
        self._send(HTTPStatus.OK, home(s, reviewer, trainable[:s.listed], recent[0].prompt if recent else "", notice,
                                       error, untrainable=len(unrated) - len(trainable)))

    def _pair(self, reviewer: str, a: str, b: str) -> None:
        try:
            first, second = load_generation(self.settings.client, a), load_generation(self.settings.client, b)
        except JudgementError as error:
            return self._home(reviewer, error=str(error))
        why = first.training_refusal() or second.training_refusal()
        if why is not None:  # a choice involving it could never be trained on: say so now, not at collection
            return self._home(reviewer, error=f"an answer to this prompt cannot be a training row ({why}): ask again")
        self._send(HTTPStatus.OK, pair_view(self.settings, reviewer, first, second))

    def _set_reviewer(self, fields: dict[str, str]) -> None:
        try:
            name = check_reviewer(fields.get("reviewer", ""))
        except JudgementError as error:
            return self._send(HTTPStatus.BAD_REQUEST, name_form(self.settings.token, str(error)))
        cookie = f"{COOKIE}={quote(name)}; Path=/; HttpOnly; SameSite=Strict"
        self._redirect("/", {"Set-Cookie": cookie})

    def _compare(self, fields: dict[str, str], reviewer: str) -> None:
        prompt = fields.get("prompt", "").strip()
        if not prompt or len(prompt) > MAX_PROMPT_CHARS:
            return self._home(reviewer, error=f"prompt: between 1 and {MAX_PROMPT_CHARS} characters")
        try:
            a, b = ask_pair(self.settings.model_url, prompt)
        except (OSError, ValueError, KeyError) as error:  # OSError covers urllib's errors
            return self._home(reviewer, error=f"the served policy at {self.settings.model_url} did not answer "
                                              f"({error}); is `make serve-model` running?")
        self._redirect("/pair?" + urlencode({"a": a, "b": b}))

    def _prefer(self, fields: dict[str, str], reviewer: str) -> None:
        try:
            record_preference(self.settings.client, fields.get("chosen", ""), fields.get("rejected", ""), reviewer,
                              experiment_id=self.settings.experiment_id)
        except Exception as error:  # noqa: BLE001 - shown to the reviewer, who can retry: never dropped silently
            return self._home(reviewer, error=f"your choice was NOT recorded: {error}")
        self._redirect("/?done=pair")

    def _rate(self, fields: dict[str, str], reviewer: str) -> None:
        good = {"true": True, "false": False}.get(fields.get("good", ""))
        try:
            if good is None:
                raise JudgementError("good: true or false")
            record_rating(self.settings.client, fields.get("trace", ""), good, reviewer,
                          experiment_id=self.settings.experiment_id)
        except Exception as error:  # noqa: BLE001 - shown to the reviewer, who can retry
            return self._home(reviewer, error=f"your rating was NOT recorded: {error}")
        self._redirect(f"/?done={'good' if good else 'bad'}")


def make_server(settings: ReviewSettings, host: str = "127.0.0.1", port: int = 5002) -> ThreadingHTTPServer:
    """The review page's server (not started: call ``serve_forever``)."""
    settings.token = settings.token or secrets.token_urlsafe(24)
    handler = type("BoundReviewHandler", (ReviewHandler,), {"settings": settings})
    return ThreadingHTTPServer((host, port), handler)
