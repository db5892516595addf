"""Data sources and dataset shaping for the pipeline: reviews in, prompts and preference pairs out.

Sources, all returning plain lists of review strings:

- :func:`generate_reviews`: the offline default, a *synthetic* corpus of short movie reviews built from
  templates (positive, negative and mixed sentiment). It is made up by this project, not real data.
- :func:`read_text_records`: local ``.txt`` (one review per line), ``.jsonl``, ``.csv`` and ``.parquet``
  files or directories of them. Malformed input raises :class:`DataFormatError` naming the file and line.
- :func:`load_hub_texts`: a hub dataset name (needs a network unless the dataset is cached).

Shaping: :func:`cut_prompt` (first words of a review), :func:`make_preference_pairs` (two continuations of
one prompt ranked by a judge). Nothing here imports Prefect, MLflow or DVC, and nothing writes files.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")
PREFERENCE_KEYS = ("prompt", "chosen", "rejected")

MAX_WORD_BYTES = 40
"""A review with a longer word (UTF-8 bytes) is dropped by ``bound_reviews``: no real word is this long, and one
such "word" is one pre-token for a byte-level BPE (a 1 MB one made tokenizer training quadratic)."""
PROMPT_BYTES_PER_WORD = 12
"""Prompt budget: a prompt of ``prompt_max_words`` words may have at most this many UTF-8 bytes per word. A
byte-level BPE never makes more tokens than bytes, so ``prompt_max_words * PROMPT_BYTES_PER_WORD`` bounds a
prompt in tokens; ``tasks/spec/param_rules.py`` checks that it plus the sampled tokens fits the model's positions."""


class DataFormatError(ValueError):
    """A malformed input file; the message starts with ``<file>:<line>:``."""

    def __init__(self, path: str | Path, line: int | None, message: str, hint_field: str | None = None):
        self.path = str(path)
        self.line = line
        self.hint_field = hint_field
        """For a missing text field: the record's field that looks like the text (a caller may suggest it)."""
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")


# --------------------------------------------------------------------------------------------
# the synthetic default corpus
# --------------------------------------------------------------------------------------------

# Openers are sentiment-neutral so that prompts cut from them do not give the answer away.
_OPENERS = (
    "This movie was", "The film was", "I thought this movie was", "Honestly, the film was",
    "My friends and I found this film", "Overall the movie was", "This sequel was", "The new film was",
    "I watched it last night and it was", "To be honest this picture was", "The whole movie felt",
    "After two hours I found it", "For a family film it was", "As a drama it was", "This comedy was",
    "The remake was", "From start to finish it was", "I went in expecting little and it was",
)
_SUBJECTS = (
    "the acting", "the plot", "the script", "the ending", "the soundtrack", "the cast", "the dialogue",
    "the pacing", "the story", "the photography", "the humor", "the lead actor", "the villain", "the music",
)
_POSITIVE = (
    "wonderful", "brilliant", "great", "charming", "delightful", "superb", "beautiful", "fun", "excellent",
    "lovely", "amazing", "enjoyable", "funny", "touching", "fantastic", "good", "smart", "sweet",
)
_NEGATIVE = (
    "terrible", "boring", "awful", "dull", "bad", "weak", "painful", "horrible", "disappointing", "stupid",
    "ugly", "annoying", "sad", "poor", "messy", "lame", "tedious", "worst",
)
_INTENSIFIERS = ("", "", "", "really ", "very ", "truly ", "quite ", "so ")
_POSITIVE_CLOSERS = (
    "I loved it.", "Worth seeing.", "I would watch it again.", "Highly recommended.", "A real treat.",
    "I enjoyed every minute.", "Go see it.", "What a great night out.",
)
_NEGATIVE_CLOSERS = (
    "I hated it.", "Avoid it.", "What a waste of time.", "Not worth the ticket.", "I want my money back.",
    "I was bored the whole time.", "Skip this one.", "A total mess.",
)
_NEUTRAL_CLOSERS = ("", "", "It is a movie.", "It runs two hours.", "See it if you want.")


def _adj(rng: random.Random, words: Sequence[str]) -> str:
    return rng.choice(_INTENSIFIERS) + rng.choice(words)


def _synthetic_review(rng: random.Random, kind: str) -> str:
    opener = rng.choice(_OPENERS)
    subject = rng.choice(_SUBJECTS)
    if kind == "positive":
        body = f"{opener} {_adj(rng, _POSITIVE)}, and {subject} was {_adj(rng, _POSITIVE)}."
        closer = rng.choice(_POSITIVE_CLOSERS + _NEUTRAL_CLOSERS)
    elif kind == "negative":
        body = f"{opener} {_adj(rng, _NEGATIVE)}, and {subject} was {_adj(rng, _NEGATIVE)}."
        closer = rng.choice(_NEGATIVE_CLOSERS + _NEUTRAL_CLOSERS)
    else:  # mixed: one clause each way, either order
        first, second = (_POSITIVE, _NEGATIVE) if rng.random() < 0.5 else (_NEGATIVE, _POSITIVE)
        body = f"{opener} {_adj(rng, first)}, but {subject} was {_adj(rng, second)}."
        closer = rng.choice(_NEUTRAL_CLOSERS + _POSITIVE_CLOSERS[:2] + _NEGATIVE_CLOSERS[:2])
    return f"{body} {closer}".strip()


def generate_reviews(n: int, seed: int = 0, mix: tuple[float, float, float] = (0.4, 0.4, 0.2)) -> list[str]:
    """``n`` synthetic short movie reviews: ``mix`` = shares of positive, negative and mixed sentiment.

    Deterministic for a given ``seed``. Synthetic by construction: templates, not real reviews.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    kinds = rng.choices(("positive", "negative", "mixed"), weights=mix, k=n)
    return [_synthetic_review(rng, kind) for kind in kinds]


# --------------------------------------------------------------------------------------------
# local files
# --------------------------------------------------------------------------------------------

TEXT_ENCODING = "utf-8-sig"
"""UTF-8, with a leading byte-order mark dropped: Excel's "CSV UTF-8" export and some editors start the file with
one, which would otherwise become part of the first field's name (``'\\ufeffprompt'``)."""


def _not_utf8(path: Path, err: UnicodeDecodeError) -> DataFormatError:
    """A ``DataFormatError`` naming the file and the line of the first byte that is not UTF-8.

    Text-mode reads decode in buffered chunks, so the reader's own line counter may not have reached the bad
    byte yet: the line is recomputed from the raw bytes (only on this error path).
    """
    line: int | None = None
    try:
        raw = path.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as first:
            prefix = raw[: first.start].decode("utf-8")
            line = prefix.count("\n") + prefix.count("\r") - prefix.count("\r\n") + 1
    except OSError:
        pass
    return DataFormatError(path, line, f"not UTF-8 text ({err.reason})")


def _jsonl_records(path: Path) -> Iterable[tuple[int, dict]]:
    try:
        with open(path, encoding=TEXT_ENCODING) as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataFormatError(path, lineno, f"invalid JSON at column {err.colno} ({err.msg})") from None
                if not isinstance(record, dict):
                    raise DataFormatError(path, lineno, f"expected a JSON object, got {type(record).__name__}")
                yield lineno, record
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err) from None


def _csv_records(path: Path) -> Iterable[tuple[int, dict]]:
    try:
        yield from _csv_rows(path)
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err) from None


def _csv_rows(path: Path) -> Iterable[tuple[int, dict]]:
    with open(path, encoding=TEXT_ENCODING, newline="") as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            raise DataFormatError(path, 1, f"invalid CSV header ({err})") from None
        try:
            for row in reader:
                lineno = reader.line_num
                if not row:
                    continue
                if len(row) != len(header):
                    raise DataFormatError(path, lineno, f"expected {len(header)} fields, got {len(row)}")
                yield lineno, dict(zip(header, row))
        except csv.Error as err:
            raise DataFormatError(path, reader.line_num, f"invalid CSV ({err})") from None


def _parquet_records(path: Path) -> Iterable[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - any reader error is a format error of this file
        raise DataFormatError(path, None, f"cannot read parquet ({err})") from None
    for row_index, record in enumerate(table.to_pylist(), start=1):
        yield row_index, record  # "line" = 1-based row number


def _text_records(path: Path, text_field: str) -> Iterable[tuple[int, dict]]:
    try:
        with open(path, encoding=TEXT_ENCODING) as fh:
            for lineno, line in enumerate(fh, start=1):
                if line.strip():
                    yield lineno, {text_field: line.strip()}
    except UnicodeDecodeError as err:  # the decoder may fail before the first line is counted
        raise _not_utf8(path, err) from None


def iter_records(path: str | Path, text_field: str = "text") -> Iterable[tuple[Path, int, dict]]:
    """Yield ``(file, line, record)`` from a file or a directory of supported files (sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    elif path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise DataFormatError(path, None, f"unsupported file type {path.suffix!r} (use {', '.join(TEXT_SUFFIXES)})")
        files = [path]
    else:
        raise FileNotFoundError(f"{path}: no such file or directory")
    for file in files:
        suffix = file.suffix.lower()
        if suffix in (".jsonl", ".json"):
            records = _jsonl_records(file)
        elif suffix == ".csv":
            records = _csv_records(file)
        elif suffix == ".parquet":
            records = _parquet_records(file)
        else:
            records = _text_records(file, text_field)
        for lineno, record in records:
            yield file, lineno, record


HUB_PREFIX = "hub:"
"""A source named ``hub:<dataset>`` is a ``datasets.load_dataset`` name (a hub id, or a dataset folder)."""


def iter_hub_records(name: str, split: str = "train", revision: str = "") -> Iterable[tuple[str, int, dict]]:
    """Yield ``("hub:<name>[<split>]", row, record)`` of a dataset's split (``datasets.load_dataset``: a hub id
    needs a network; a local dataset folder does not), rows numbered from 1."""
    from datasets import load_dataset

    where = f"{HUB_PREFIX}{name}[{split}]"
    try:
        dataset = load_dataset(name, split=split, revision=revision or None)
    except Exception as error:  # noqa: BLE001 - no network, no such dataset or split, files it cannot build from
        raise DataFormatError(where, None, f"the dataset cannot be loaded ({type(error).__name__}: {error})") from error
    for row, record in enumerate(dataset, start=1):
        yield where, row, dict(record)


def iter_source_records(source: str | Path, text_field: str = "text", split: str = "train",
                        revision: str = "") -> Iterable[tuple[str | Path, int, dict]]:
    """:func:`iter_records` of a local file or folder, or :func:`iter_hub_records` of ``hub:<dataset>``
    (``split``, ``revision``: the hub dataset's)."""
    if isinstance(source, str) and source.startswith(HUB_PREFIX):
        return iter_hub_records(source[len(HUB_PREFIX):], split, revision)
    return iter_records(source, text_field)


def read_text_records(path: str | Path, text_field: str = "text", limit: int = 0) -> list[str]:
    """Review texts from local files. Every record must carry a non-empty string ``text_field``."""
    texts = []
    for file, lineno, record in iter_records(path, text_field):
        texts.append(_require_text(file, lineno, record, text_field))
        if limit and len(texts) >= limit:
            break
    return texts


def text_like_field(record: dict) -> str | None:
    """The field of ``record`` holding the longest string of several words (a likely review text), if any."""
    texts = {str(k): v for k, v in record.items() if isinstance(v, str) and len(v.split()) >= 3}
    return max(texts, key=lambda k: len(texts[k])) if texts else None


def _require_text(file: Path, lineno: int, record: dict, key: str, strip: bool = True) -> str:
    if key not in record:
        hint = text_like_field(record)
        raise DataFormatError(file, lineno, f"missing field {key!r} (fields: {', '.join(map(str, record)) or 'none'})"
                              + (f"; the text looks like it is in {hint!r}" if hint else ""), hint_field=hint)
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(file, lineno, f"field {key!r} must be a non-empty string, got {value!r}")
    return value.strip() if strip else value


@dataclass
class IncomingData:
    """New data for retraining: extra reviews, preference pairs and unpaired ratings (prompt, completion, label)."""

    reviews: list[str]
    pairs: list[dict]
    ratings: list[dict] = field(default_factory=list)


def load_hub_texts(name: str, split: str = "train", text_field: str = "text", revision: str = "", limit: int = 0) -> list[str]:
    """Review texts from a hub dataset (e.g. ``stanfordnlp/imdb``, ``rotten_tomatoes``); needs a network."""
    from datasets import load_dataset

    ds = load_dataset(name, split=split, revision=revision or None)
    if text_field not in ds.column_names:
        raise ValueError(f"hub dataset {name!r} has no column {text_field!r} (columns: {ds.column_names})")
    texts = [t.strip() for t in ds[text_field] if isinstance(t, str) and t.strip()]
    return texts[:limit] if limit else texts


# --------------------------------------------------------------------------------------------
# shaping
# --------------------------------------------------------------------------------------------


def clean_text(text: str, max_words: int) -> str:
    """Collapse whitespace (HTML line breaks included) and truncate to ``max_words`` words."""
    words = text.replace("<br />", " ").replace("<br/>", " ").split()
    return " ".join(words[:max_words])


def cut_prompt(text: str, n_words: int) -> tuple[str, str]:
    """Split a review into (prompt = its first ``n_words`` words, continuation = the rest, with its space)."""
    words = text.split()
    n = max(1, min(n_words, len(words) - 1))
    return " ".join(words[:n]), (" " + " ".join(words[n:])) if len(words) > n else ""


def prompt_token_budget(prompt_max_words: int) -> int:
    """The most tokens (byte-level BPE: at most one per UTF-8 byte) a prompt kept by ``bound_reviews`` can have."""
    return prompt_max_words * PROMPT_BYTES_PER_WORD


def review_overlong(text: str, prompt_max_words: int) -> str | None:
    """Why ``text`` (a cleaned review) would overflow a later stage, or None: a word over ``MAX_WORD_BYTES``
    bytes, or its first ``prompt_max_words`` words (the longest prompt cut from it) over the prompt budget."""
    words = text.split()
    longest = max((len(w.encode("utf-8")) for w in words), default=0)
    if longest > MAX_WORD_BYTES:
        return f"a {longest}-byte word (limit {MAX_WORD_BYTES})"
    prompt = " ".join(words[:prompt_max_words]).encode("utf-8")
    if len(prompt) > prompt_token_budget(prompt_max_words):
        return f"a {len(prompt)}-byte prompt (limit {prompt_token_budget(prompt_max_words)})"
    return None


def bound_reviews(texts: Sequence[str], prompt_max_words: int) -> tuple[list[str], list[str]]:
    """Split cleaned reviews into (kept, reasons for each dropped one) by :func:`review_overlong`."""
    kept, dropped = [], []
    for text in texts:
        reason = review_overlong(text, prompt_max_words)
        (dropped if reason else kept).append(reason or text)
    return kept, dropped


def check_preference_pair(pair: dict, file: str | Path, line: int | None) -> dict:
    """An incoming pair must offer a choice: ``chosen`` and ``rejected`` differ (ignoring surrounding space);
    otherwise a :class:`DataFormatError` naming ``file:line``. Returns ``pair``."""
    if pair["chosen"].strip() == pair["rejected"].strip():
        raise DataFormatError(file, line, "'chosen' and 'rejected' are the same text: a pair must offer a choice")
    return pair


def pairs_with_margin(pairs: Sequence[dict], chosen_scores: Sequence[float], rejected_scores: Sequence[float],
                      min_margin: float) -> tuple[list[dict], int]:
    """Incoming pairs with their gold scores, kept only where the judge agrees with the label by at least
    ``min_margin`` (chosen - rejected >= margin), the rule generated pairs follow; returns (kept, dropped count)."""
    kept = [{**pair, "chosen_score": float(sc), "rejected_score": float(sr)}
            for pair, sc, sr in zip(pairs, chosen_scores, rejected_scores) if sc - sr >= max(min_margin, 1e-9)]
    return kept, len(pairs) - len(kept)


def ratings_with_margin(ratings: Sequence[dict], scores: Sequence[float], threshold: float = 0.0,
                        min_margin: float = 0.0) -> tuple[list[dict], int]:
    """Incoming ratings with their gold score, kept only where the judge gives the same label by at least
    ``min_margin`` (the rule :func:`make_unpaired_ratings` labels generated rows by); returns (kept, dropped count).
    Example: labels [True, True, False], scores [0.6, 0.02, 0.3], margin 0.05 -> the first kept (0.02 is within the
    margin, 0.3 says desirable)."""
    kept = [{**rating, "score": float(s)} for rating, s in zip(ratings, scores)
            if s != threshold and (s > threshold) == rating["label"] and abs(s - threshold) >= min_margin]
    return kept, len(ratings) - len(kept)


def split_train_eval(texts: Sequence[str], eval_fraction: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """Shuffle and split into (train, held-out); held-out has at least one item when there are two or more."""
    items = list(texts)
    random.Random(seed).shuffle(items)
    n_eval = max(1, round(len(items) * eval_fraction)) if len(items) >= 2 else 0
    return items[n_eval:], items[:n_eval]


def make_prompts(texts: Sequence[str], min_words: int, max_words: int, seed: int = 0) -> list[str]:
    """One prompt per review: its first N words, N uniform in [min_words, max_words]."""
    rng = random.Random(seed)
    return [cut_prompt(t, rng.randint(min_words, max_words))[0] for t in texts if len(t.split()) > 1]


def make_preference_pairs(
    texts: Sequence[str],
    judge: Callable[[list[str]], list[float]],
    min_words: int,
    max_words: int,
    pairs_per_review: int = 1,
    min_margin: float = 0.0,
    seed: int = 0,
) -> list[dict]:
    """Preference pairs labelled by ``judge`` (higher = better).

    For each review: prompt = its first N words; candidate A = its own continuation; candidate B = the
    continuation, after N words, of another review that starts with the same N words (any other review
    when none does). The judge scores prompt + candidate;
    the better one is ``chosen``. Pairs closer than ``min_margin`` or with identical candidates are dropped.
    Returns dicts with prompt, chosen, rejected (continuations, leading space kept), chosen_score, rejected_score.
    """
    rng = random.Random(seed)
    usable = [t for t in texts if len(t.split()) > 1]
    if len(usable) < 2:
        return []
    by_prefix: dict[tuple[int, str], list[int]] = {}
    for i, text in enumerate(usable):
        for n in range(min_words, max_words + 1):
            by_prefix.setdefault((n, cut_prompt(text, n)[0]), []).append(i)
    raw = []
    for i, text in enumerate(usable):
        for _ in range(pairs_per_review):
            n = rng.randint(min_words, max_words)
            prompt, own = cut_prompt(text, n)
            same = by_prefix[(n, prompt)]
            if len(same) > 1:  # prefer a review that starts the same way: both candidates read naturally
                j = same[rng.randrange(len(same))]
                while j == i:
                    j = same[rng.randrange(len(same))]
            else:
                j = rng.randrange(len(usable) - 1)
                j = j + 1 if j >= i else j
            _, other = cut_prompt(usable[j], n)
            if own and other and own != other:
                raw.append((prompt, own, other))
    scores = judge([p + a for p, a, _ in raw] + [p + b for p, _, b in raw])
    score_a, score_b = scores[: len(raw)], scores[len(raw):]
    pairs = []
    for (prompt, a, b), sa, sb in zip(raw, score_a, score_b):
        if abs(sa - sb) < max(min_margin, 1e-9):
            continue
        chosen, rejected, sc, sr = (a, b, sa, sb) if sa > sb else (b, a, sb, sa)
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                      "chosen_score": float(sc), "rejected_score": float(sr)})
    return pairs


def write_jsonl(records: Iterable[dict], path: str | Path) -> int:
    """Write records as JSON lines; returns the count. (Callers write to a temp path and rename.)"""
    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[dict]:
    """Read JSON lines written by :func:`write_jsonl` (errors name file and line)."""
    return [record for _, record in _jsonl_records(Path(path))]


# --------------------------------------------------------------------------------------------
# unpaired ratings (KTO): prompt, completion, label true/false
# --------------------------------------------------------------------------------------------

RATING_KEYS = ("prompt", "completion", "label")


def make_unpaired_ratings(texts: Sequence[str], judge: Callable[[list[str]], list[float]], min_words: int,
                          max_words: int, threshold: float = 0.0, min_margin: float = 0.0, seed: int = 0
                          ) -> list[dict]:
    """Thumbs-up/down rows from a corpus and a judge (higher = better): one per review with a continuation.

    prompt = the review's first N words (N uniform in [min_words, max_words]), completion = the rest (leading
    space kept); the judge scores prompt + completion and ``label = score > threshold``. Rows scoring within
    ``min_margin`` of the threshold (ambiguous ratings) are dropped. Returns dicts with prompt, completion,
    label (bool) and score (float), in corpus order.
    Example: judge scores [0.6, -0.4, 0.05] with threshold 0, margin 0.1 -> labels [True, False], third dropped.
    """
    rng = random.Random(seed)
    raw = []
    for text in texts:
        if len(text.split()) > 1:
            prompt, completion = cut_prompt(text, rng.randint(min_words, max_words))
            if completion.strip():
                raw.append((prompt, completion))
    scores = judge([p + c for p, c in raw]) if raw else []
    return [
        {"prompt": p, "completion": c, "label": bool(s > threshold), "score": float(s)}
        for (p, c), s in zip(raw, scores)
        if abs(s - threshold) >= min_margin and s != threshold
    ]


def check_rating(file: str | Path, lineno: int | None, record: dict) -> dict:
    """One rating row validated: prompt and completion non-empty strings, label a JSON bool.

    Returns ``{"prompt", "completion", "label"}`` (texts kept as written); a bad row raises
    :class:`DataFormatError` naming ``file`` and ``lineno``.
    """
    row = {key: _require_text(Path(file), lineno, record, key, strip=False) for key in ("prompt", "completion")}
    if "label" not in record:
        raise DataFormatError(file, lineno, f"missing field 'label' (fields: {', '.join(map(str, record)) or 'none'})")
    if not isinstance(record["label"], bool):
        raise DataFormatError(file, lineno, f"field 'label' must be true or false, got {record['label']!r}")
    row["label"] = record["label"]
    return row


def read_ratings(path: str | Path) -> list[dict]:
    """Unpaired ratings from a JSON-lines file (or a directory of them): prompt, completion, label per row.

    Every row is checked by :func:`check_rating`; errors name the file and line.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    return [check_rating(file, lineno, record) for file in files for lineno, record in _jsonl_records(file)]
