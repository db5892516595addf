"""Reviewers' judgements of served generations, kept as MLflow assessments (feedback) on the generations' traces.

Two kinds of judgement, both human feedback whose source id is the reviewer:

- **a rating** (KTO's unpaired data): feedback ``good`` = true or false on one trace. Made in MLflow's own trace
  view (the trace's "Add feedback": name ``good``, type boolean), on the review page (``make review``), or with
  :func:`record_rating` / ``mlflow.log_feedback(trace_id=..., name="good", value=True, source=...)``;
- **a preference** (DPO's and the reward model's pairs): feedback ``preferred`` = true on the chosen trace with the
  rejected trace in its metadata (``rejected_trace_id``), and ``preferred`` = false on the rejected trace naming
  the chosen one (so either trace shows the judgement). Made on the review page, side by side, or with
  :func:`record_preference`. Both traces must answer the same prompt.

A served generation is a trace the served policy wrote (``tasks/serving/answer.py``): tag ``rlhf.served``, root span inputs
``prompt``, output ``completion``. :func:`generation` reads one back; ``tasks/feedback/collect.py`` turns the
judgements into feedback batches.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow.entities import AssessmentSource, AssessmentSourceType
from mlflow.exceptions import MlflowException

from rlhf_core.data import DataFormatError
from rlhf_core.feedback import IntakeLimits, canonical_row
from tasks.serving.answer import MODEL_VERSION_TAG, SERVED_TAG

RATING = "good"
"""Feedback name of a rating (boolean: true = a good answer)."""
PREFERENCE = "preferred"
"""Feedback name of a side-by-side choice (boolean; true on the chosen trace)."""
CHOSEN_KEY, REJECTED_KEY = "chosen_trace_id", "rejected_trace_id"
"""Metadata keys of a preference: the other trace of the pair."""
MAX_REVIEWER_CHARS = 64


class JudgementError(ValueError):
    """A judgement that cannot be recorded (the message names what is wrong); nothing was written."""

HIDDEN_CATEGORIES = {"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"}
"""Unicode categories refused in a reviewer's name: controls, format characters (zero-width joiners and spaces,
direction overrides such as U+202E), private-use, unassigned: a name that looks like another's would credit them."""
BIDI = {"RLO", "LRO", "RLE", "LRE", "RLI", "LRI", "FSI", "PDF", "PDI"}


@dataclass(frozen=True)
class Generation:
    """One served generation, read back from its trace."""

    trace_id: str
    prompt: str
    completion: str
    model_version: str
    assessments: list = field(default_factory=list, compare=False)
    """The trace's MLflow assessments (judgements already made on it)."""

    def training_refusal(self) -> str | None:
        """Why the intake would refuse this generation as a training row (an empty answer, a NUL character, a text
        over the limit), or None. A judgement of it is refused when it is made, not found refused at collection."""
        row = {"prompt": self.prompt, "completion": self.completion, "label": True}
        try:
            canonical_row(Path(f"trace {self.trace_id}"), None, "ratings", row, IntakeLimits())
        except DataFormatError as error:
            return str(error).split(": ", 1)[1]
        return None

    def judged_by(self, reviewer: str, name: str) -> bool:
        """Whether ``reviewer`` already gave a (valid) ``name`` judgement on this generation."""
        return any(a.name == name and a.valid is not False and a.source and a.source.source_id == reviewer
                   for a in self.assessments)


def check_reviewer(name) -> str:
    """The reviewer's name as recorded (the assessment's source id), or :class:`JudgementError` saying why not."""
    if not isinstance(name, str) or not name.strip():
        raise JudgementError("reviewer: a name is needed (it is recorded with every judgement)")
    # NFKC: a full-width or ligature look-alike is recorded as the plain name; runs of spaces count as one
    name = " ".join(unicodedata.normalize("NFKC", name).split())
    if len(name) > MAX_REVIEWER_CHARS:
        raise JudgementError(f"reviewer: {len(name)} characters (limit {MAX_REVIEWER_CHARS})")
    hidden = next((c for c in name if unicodedata.category(c) in HIDDEN_CATEGORIES), None)
    if hidden is not None:
        kind = "a direction control" if unicodedata.bidirectional(hidden) in BIDI else "an invisible or control character"
        raise JudgementError(f"reviewer: the name contains {kind} (U+{ord(hidden):04X}): type it plainly")
    return name


def generation(trace) -> Generation | None:
    """The served generation a trace (with its spans) records, or None when the served policy did not write it."""
    info = trace.info
    if info.tags.get(SERVED_TAG) != "true" or not trace.data.spans:
        return None
    root = next((s for s in trace.data.spans if s.parent_id is None), trace.data.spans[0])
    inputs, outputs = root.inputs or {}, root.outputs or {}
    prompt, completion = inputs.get("prompt"), outputs.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return None
    return Generation(info.trace_id, prompt, completion, info.tags.get(MODEL_VERSION_TAG, ""), list(info.assessments))


def load_generation(client, trace_id: str, experiment_id: str | None = None) -> Generation:
    """The served generation of ``trace_id`` (:class:`JudgementError` when there is none, or, with
    ``experiment_id``, when it belongs to another experiment: the collection reads only the project's)."""
    try:
        trace = client.get_trace(trace_id)
    except MlflowException:
        raise JudgementError(f"trace {trace_id!r}: no such trace in the tracking store") from None
    if experiment_id is not None and str(trace.info.experiment_id) != str(experiment_id):
        raise JudgementError(f"trace {trace_id!r} belongs to experiment {trace.info.experiment_id}, not the "
                             f"project's ({experiment_id}): its judgements would never be collected")
    found = generation(trace)
    if found is None:
        raise JudgementError(f"trace {trace_id!r} is not a generation of the served policy")
    return found


def recent_generations(client, experiment_id: str, limit: int = 20) -> list[Generation]:
    """The newest served generations of the experiment, newest first."""
    traces = client.search_traces(locations=[experiment_id], filter_string=f"tags.`{SERVED_TAG}` = 'true'",
                                  order_by=["timestamp_ms DESC"], max_results=limit)
    return [g for g in map(generation, traces) if g is not None]


def _trainable(judged: Generation) -> Generation:
    """``judged``, or :class:`JudgementError` when the intake could never train on it (the reason named)."""
    why = judged.training_refusal()
    if why is not None:
        raise JudgementError(f"trace {judged.trace_id}: its answer cannot be a training row ({why})")
    return judged


def _human(reviewer: str):
    return AssessmentSource(source_type=AssessmentSourceType.HUMAN, source_id=check_reviewer(reviewer))


def record_rating(client, trace_id: str, good: bool, reviewer: str, rationale: str | None = None,
                  experiment_id: str | None = None):
    """Record ``reviewer``'s rating of a served generation (of ``experiment_id`` when given: the project's, the one
    the collection reads); returns the MLflow assessment."""
    if not isinstance(good, bool):
        raise JudgementError(f"{RATING}: true or false, got {good!r}")
    source = _human(reviewer)
    _trainable(load_generation(client, trace_id, experiment_id))  # checked before anything is written
    return mlflow.log_feedback(trace_id=trace_id, name=RATING, value=good, source=source, rationale=rationale)


def record_preference(client, chosen_trace_id: str, rejected_trace_id: str, reviewer: str,
                      rationale: str | None = None, experiment_id: str | None = None):
    """Record that ``reviewer`` prefers the chosen generation to the rejected one (same prompt); returns the
    assessment on the chosen trace (the one the intake reads: it holds the whole judgement)."""
    source = _human(reviewer)
    if chosen_trace_id == rejected_trace_id:
        raise JudgementError("a preference needs two different traces")
    chosen = _trainable(load_generation(client, chosen_trace_id, experiment_id))
    rejected = _trainable(load_generation(client, rejected_trace_id, experiment_id))
    if chosen.prompt != rejected.prompt:
        raise JudgementError(f"traces {chosen_trace_id} and {rejected_trace_id} answer different prompts")
    assessment = mlflow.log_feedback(trace_id=chosen_trace_id, name=PREFERENCE, value=True, source=source,
                                     rationale=rationale, metadata={REJECTED_KEY: rejected_trace_id})
    mlflow.log_feedback(trace_id=rejected_trace_id, name=PREFERENCE, value=False, source=source,
                        metadata={CHOSEN_KEY: chosen_trace_id, "assessment_id": assessment.assessment_id})
    return assessment
