"""Run TRL's own clients (example scripts, notebooks, docs snippets) against real TRL and against rlhf_core, and
write the table: client, TRL result, rlhf_core result.

    python bench/trl_examples/run.py --trl <trl v0.11.4 checkout> [--trl1 <tree with trl/scripts of 1.x>]
        [--only NAME_SUBSTRING] [--out docs/trl_clients.md]

Each client runs as published, in a fresh folder holding the tiny fixtures (``fixtures.py``, built once per venv):
with the baseline venv's python on the original source, and with the project's python on the source whose
``trl`` import lines (only those) now say ``rlhf_core``. Nothing is downloaded (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from clients import CLIENTS  # noqa: E402


BASELINES = {"0.11": HERE.parent / ".trl-era-venv" / "bin" / "python",
             "1.x": HERE.parent / ".trl116-venv" / "bin" / "python"}
BASELINE_NAMES = {"0.11": "trl 0.11.4 (release-era libraries)", "1.x": "trl 1.16.0"}
IMPORT_LINE = re.compile(r"^(\s*)(from\s+trl(\.[\w.]+)?\s+import\b|import\s+trl(\.[\w.]+)?\b)")


def rewrite_imports(source: str) -> str:
    """``from trl... import`` / ``import trl...`` lines point at rlhf_core; every other line is left as it is."""
    def one(line: str) -> str:
        match = IMPORT_LINE.match(line)
        if not match:
            return line
        if line.lstrip().startswith("import"):  # `import trl` -> `import rlhf_core as trl`, names unchanged
            return re.sub(r"\bimport\s+trl\b(\.[\w.]+)?", lambda m: f"import rlhf_core{m.group(1) or ''} as trl"
                          if not m.group(1) else f"import rlhf_core{m.group(1)}", line, count=1)
        return re.sub(r"\bfrom\s+trl\b", "from rlhf_core", line, count=1)

    return "\n".join(one(line) for line in source.split("\n"))


# what the notebook runtime (IPython) provides that a script lacks: its `display` builtin, printing here
NOTEBOOK_PRELUDE = "display = print  # IPython's builtin (harness prelude)"


# what a CPU-only reader passes that the TRL 1.x docs snippets leave out: TRL 1.x's configs default to bf16, which
# transformers refuses on a CPU unless `use_cpu=True` (its error says so). Both sides get the same lines.
CPU_PRELUDE = """import transformers as _harness_transformers  # harness prelude: use_cpu=True, as a CPU-only reader passes
_harness_post_init = _harness_transformers.TrainingArguments.__post_init__


def _harness_cpu_post_init(self, *args, **kwargs):
    self.use_cpu = True
    return _harness_post_init(self, *args, **kwargs)


_harness_transformers.TrainingArguments.__post_init__ = _harness_cpu_post_init
"""


def notebook_code(text: str) -> str:
    cells = json.loads(text)["cells"]
    lines = [NOTEBOOK_PRELUDE]
    for cell in cells:
        if cell["cell_type"] == "code":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            lines += [ln for ln in source.split("\n") if not ln.lstrip().startswith(("%", "!"))]
    return "\n".join(lines) + "\n"


def doc_block(text: str, n: int | tuple[int, ...]) -> str:
    """The n-th ```python (or ```py) block of a docs page; for a tuple, those blocks joined in order: a page that
    builds one program across its blocks, as a reader following it pastes them."""
    blocks = re.findall(r"```py(?:thon)?\n(.*?)```", text, flags=re.S)
    return "\n".join(blocks[i] for i in n) if isinstance(n, tuple) else blocks[n]


def client_source(client: dict, trees: dict[str, Path]) -> str:
    kind, path, *rest = client["source"]
    text = (trees[client.get("tree", client["era"])] / path).read_text(encoding="utf-8")
    if kind == "notebook":
        return notebook_code(text)
    if kind == "doc":
        return (CPU_PRELUDE if client.get("cpu_prelude") else "") + doc_block(text, rest[0])
    return text


def last_error(output: str) -> str:
    """The line that says why a run failed: the exception line of the last traceback, else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b.*", line) or re.match(r"^[\w.]+Error:", line):
            return line[:220]
    return (lines[-1] if lines else "")[:220]


def run_one(python: Path, script: Path, args: list[str], cwd: Path, timeout: int, pythonpath: str = "") -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="disabled", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=pythonpath, MPLBACKEND="Agg")
    start = time.time()
    try:
        done = subprocess.run([str(python), str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        rc, output = "timeout", f"timed out after {timeout} s\n{expired.stderr or ''}"
    (cwd / "output.log").write_text(output if isinstance(output, str) else str(output))
    return {"ok": rc == 0, "rc": rc, "seconds": round(time.time() - start, 1),
            "error": "" if rc == 0 else last_error(output if isinstance(output, str) else "")}


def fixtures_for(python: Path, work: Path, label: str) -> Path:
    hub = work / "hub" / label
    if not (hub / ".done").exists():
        shutil.rmtree(hub, ignore_errors=True)
        subprocess.run([str(python), str(HERE / "fixtures.py"), str(hub)], check=True, capture_output=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=""))
        (hub / ".done").write_text("")
    return hub


def run_client(client: dict, trees: dict[str, Path], rlhf_python: Path, work: Path, timeout: int) -> dict:
    row = {"name": client["name"], "era": client["era"], "note": client.get("note", "")}
    try:
        source = client_source(client, trees)
    except (ValueError, IndexError, OSError) as error:  # e.g. a notebook that is not valid JSON as published
        failed = {"ok": False, "rc": None, "seconds": 0.0, "error": f"not runnable as published: {error}"[:220]}
        print(f"{client['name']:60s} both      {failed['error']}", flush=True)
        return {**row, "trl": failed, "rlhf_core": dict(failed)}
    for side, python, code in (("trl", BASELINES[client["era"]], source),
                               ("rlhf_core", rlhf_python, rewrite_imports(source))):
        hub = fixtures_for(python, work, "rlhf_core" if side == "rlhf_core" else client["era"])
        folder = work / "runs" / re.sub(r"\W+", "_", client["name"]) / side
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(hub, folder, symlinks=True)
        if client["source"][0] == "notebook":  # they log to wandb by name: an offline stand-in, both sides alike
            shutil.copytree(HERE / "stubs", folder, dirs_exist_ok=True)
        script = folder / "client.py"
        script.write_text(code, encoding="utf-8")
        args = [a.replace("{out}", str(folder / "out")) for a in client["args"]]
        # rlhf_core from this checkout (the venv may hold another editable install)
        row[side] = run_one(python, script, args, folder, timeout, str(ROOT) if side == "rlhf_core" else "")
        print(f"{client['name']:60s} {side:9s} {'ok' if row[side]['ok'] else 'FAIL'} "
              f"{row[side]['seconds']:7.1f}s {row[side]['error']}", flush=True)
    return row


def cell(result: dict) -> str:
    if result["ok"]:
        return "runs"
    error = result["error"].replace(str(ROOT) + "/", "").replace("|", "/").replace("`", "'")  # no machine paths
    return f"fails: `{error}`"


def table(rows: list[dict], command: str) -> str:
    lines = ["<!-- generated by bench/trl_examples/run.py: do not edit by hand -->",
             "# TRL's own clients: real TRL, and rlhf_core with only the `trl` import lines changed", "",
             "[Back to the README](../README.md). How they run: [bench/trl_examples/README.md]"
             "(../bench/trl_examples/README.md).", "", f"Command: `{command}`", "",
             "| client | TRL | TRL result | rlhf_core result | note |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['name']} | {BASELINE_NAMES[row['era']]} | {cell(row['trl'])} | "
                     f"{cell(row['rlhf_core'])} | {row.get('note', '')} |")
    lines.append("")
    for era in BASELINE_NAMES:
        mine = [r for r in rows if r["era"] == era]
        both = [r for r in mine if r["trl"]["ok"]]
        lines.append(f"- {BASELINE_NAMES[era]}: of the {len(both)} clients it runs here, rlhf_core runs "
                     f"{sum(r['rlhf_core']['ok'] for r in both)}; of all {len(mine)}, rlhf_core runs "
                     f"{sum(r['rlhf_core']['ok'] for r in mine)}.")
    return "\n".join(lines) + "\n"


def default_trl1() -> Path | None:
    found = glob.glob(str(HERE.parent / ".trl116-venv" / "lib" / "python3*" / "site-packages"))
    return Path(found[0]) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl", type=Path, required=True, help="a TRL v0.11.4 checkout (examples/, docs/)")
    parser.add_argument("--trl1", type=Path, default=default_trl1(), help="a tree holding trl/scripts of TRL 1.x")
    parser.add_argument("--trl1-docs", type=Path, default=HERE.parent / ".cache" / "trl-v1.9.0",
                        help="a TRL 1.x checkout whose docs/ the 1.x docs snippets come from (1.16's sdist has none)")
    parser.add_argument("--python", type=Path, default=Path(sys.executable),
                        help="the python rlhf_core runs under (default: this one, e.g. the project's .venv)")
    parser.add_argument("--work", type=Path, default=HERE / ".work")
    parser.add_argument("--only", default="", help="run the clients whose name contains this")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--from-results", action="store_true",
                        help="write the table of the last run's results.json (notes from clients.py), running nothing")
    args = parser.parse_args()
    if args.from_results:
        notes = {c["name"]: c.get("note", "") for c in CLIENTS}
        rows = [{**r, "note": notes.get(r["name"], r.get("note", ""))}
                for r in json.loads((args.work / "results.json").read_text())]
        text = table(rows, "python bench/trl_examples/run.py --trl " + os.path.relpath(args.trl.absolute(), ROOT)
                     + " --out docs/trl_clients.md")
        print(text)
        if args.out:
            args.out.write_text(text)
        return
    trees = {"0.11": args.trl, "1.x": args.trl1, "1.x-docs": args.trl1_docs}
    for era, python in BASELINES.items():
        if not python.exists():
            sys.exit(f"{python} is missing: build it first (bench/setup_trl_era_venv.sh, bench/setup_trl116_venv.sh)")
    chosen = [c for c in CLIENTS if args.only in c["name"]]
    rows = [run_client(c, trees, args.python.absolute(), args.work.absolute(), args.timeout) for c in chosen]
    (args.work / "results.json").write_text(json.dumps(rows, indent=1))
    command = "python bench/trl_examples/run.py " + " ".join(
        a if not a.startswith("/") else os.path.relpath(a, ROOT) for a in sys.argv[1:])
    text = table(rows, command)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
