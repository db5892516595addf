"""Issue 36.3: a launch spanning two "nodes": two ``torchrun --nnodes 2`` launchers (``--node_rank`` 0 and 1, one
process each, the rendezvous on 127.0.0.1) train the ``sft`` stage of a tiny project together.

Each node gets its own cache directories (``HF_HOME``, ``XDG_CACHE_HOME``: node-local disks on a cluster), and both
processes see LOCAL_RANK 0: each is its node's local main process, but only global rank 0 may write the project.
Checked: both launchers exit 0; the stage ran on 2 processes with identical weights; the outputs, the MLflow run and
the Prefect flow run exist once; the audit hook of tests/test_stage_distributed.py saw global rank 1 write nothing
in the project (rank 0's writes are the control); and nothing in the project names a node cache. This is the
command docs/scale.md gives for SLURM (``srun``) and Kubernetes (PyTorchJob), with 127.0.0.1 for the head node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _launch import free_port
from _pipeline_project import make_project, mlflow_client
from test_stage_distributed import AUDIT_HOOK, _changed, _expected_change, _tree

pytestmark = pytest.mark.slow


def two_node_command(node_rank: int, port: int, *args: str) -> list[str]:
    """What each node runs (docs/scale.md): one process per node, a static rendezvous on the head node."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
            "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), *args]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    base = tmp_path_factory.mktemp("two-nodes")
    root = make_project(base / "proj", git_dvc=False).resolve()
    (base / "hook").mkdir()
    (base / "hook" / "sitecustomize.py").write_text(AUDIT_HOOK)
    audit, saved = base / "audit.log", {k: os.environ.pop(k, None) for k in ("MLFLOW_TRACKING_URI", "RLHF_PARENT_RUN_ID")}
    try:
        with prefect_test_harness(server_startup_timeout=120):
            env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "OMP_NUM_THREADS": "1",
                   "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                   "PYTHONDONTWRITEBYTECODE": "1", "RLHF_AUDIT_ROOT": str(root), "RLHF_AUDIT_LOG": str(audit),
                   "PYTHONPATH": os.pathsep.join([str(base / "hook"), *filter(None, [os.environ.get("PYTHONPATH")])])}
            prepare = subprocess.run([sys.executable, "-m", "flows.stage", "prepare"], cwd=root, env=env,
                                     capture_output=True, text=True, timeout=300)
            assert prepare.returncode == 0, prepare.stderr[-4000:]
            before, port = _tree(root), free_port()
            nodes = []
            for node in (0, 1):
                cache = base / f"node{node}-cache"  # the node's local disk
                node_env = {**env, "HF_HOME": str(cache / "hf"), "XDG_CACHE_HOME": str(cache / "xdg")}
                nodes.append(subprocess.Popen(two_node_command(node, port, "-m", "flows.stage", "sft"), cwd=root,
                                              env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outputs = [proc.communicate(timeout=500)[0] for proc in nodes]
            with get_client(sync_client=True) as client:
                flows = {f.id: f.name for f in client.read_flows()}
                flow_runs = [(flows.get(r.flow_id), r.parameters.get("name")) for r in client.read_flow_runs()]
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    return {"root": root, "base": base, "codes": [p.returncode for p in nodes], "outputs": outputs,
            "changed": _changed(before, _tree(root)), "audit": audit, "flow_runs": flow_runs}


def test_two_nodes_train_one_stage_together(launched):
    assert launched["codes"] == [0, 0], "\n".join(out[-3000:] for out in launched["outputs"])
    metrics = json.loads((launched["root"] / "metrics" / "sft.json").read_text())
    assert metrics["num_processes"] == 2
    assert "sft: weights identical on all 2 processes" in launched["outputs"][0]


def test_the_outputs_the_run_and_the_flow_run_exist_once(launched):
    root = launched["root"]
    unexpected = [p for p in launched["changed"] if not _expected_change("sft", p)]
    assert unexpected == [], unexpected
    client = mlflow_client(root)
    runs = client.search_runs([client.get_experiment_by_name("rlhf-pipeline").experiment_id])
    assert sorted(r.data.tags.get("rlhf.stage") for r in runs) == ["prepare", "sft"]
    assert sorted(launched["flow_runs"]) == [("rlhf-stage", "prepare"), ("rlhf-stage", "sft")]


def test_only_the_global_main_process_writes_the_project(launched):
    events = [line.split(" ", 2) for line in launched["audit"].read_text().splitlines()]
    armed = {e[0] for e in events if e[1] == "armed"}
    assert {"rank0", "rank1"} <= armed  # the hook ran on both nodes' processes
    assert [e for e in events if e[0] == "rank1" and e[1] != "armed"] == []  # node 1's local main wrote nothing
    assert {"metrics/sft.json", "plots/sft.csv"} <= {e[2] for e in events if e[0] == "rank0"}  # the control
    for path in (launched["root"] / "metrics" / "sft.json", launched["root"] / "models" / "sft" / "config.json"):
        assert "node0-cache" not in path.read_text() and "node1-cache" not in path.read_text()
