"""A model pulled on a chosen node of the cluster, served through another:
`manage.py pull --node p` (run by an operator on any host) queues the pull on
node p's queue; p's worker, whose host joined as p, takes it and downloads
from the Hub (the local hub, on the test network's bridge) into p's own
models directory; the model is placed on p's engine and answers a chat sent
to node a's front."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from catalog.models import ModelConfig, ModelPull
from tests.cluster import cluster_setup
from tests.cluster.netns import start_worker
from tests.conftest import ROOT
from tests.hub import LocalHub

REPO = "org/SmolLM2-135M-GGUF"
FILE = "smol.Q4_1.gguf"


def test_a_model_pulled_on_node_p_is_served_through_node_a(cluster, orm, tmp_path):
    smol = Path(os.environ.get("ROUNDHOUSE_MODELS_DIR", ROOT / "var" / "models"))
    pulled_before = (smol / "org--SmolLM2-135M-GGUF").exists()
    p_models = tmp_path / "p-models"
    p_models.mkdir()
    with LocalHub(
        {REPO: {FILE: smol / cluster_setup.SMOL}}, host=cluster.network.gateway
    ) as hub:
        try:
            p = cluster.add_node("p", labels=["zone-p"], models_dir=p_models)
            start_worker(
                p.host,
                "worker-p",
                env=p.env | {"HF_ENDPOINT": hub.url},
                log_dir=p.log_dir,
                root=ROOT,
            )
            run_dir = tmp_path / "operator-run"
            run_dir.mkdir(mode=0o700)
            operator = cluster.nodes["a"].env | {
                "HF_ENDPOINT": hub.url,
                "ROUNDHOUSE_RUN_DIR": str(run_dir),
            }
            pulled = subprocess.run(
                [sys.executable, "manage.py", "pull", f"hf:{REPO}:Q4_1"]
                + ["--name", "pulled-p", "--node", "p"],
                env=operator,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert pulled.returncode == 0, pulled.stderr + pulled.stdout
            assert "added model pulled-p (chat)" in pulled.stdout
            pull = ModelPull.objects.get(name="pulled-p")
            assert (pull.status, pull.node) == ("done", "p")
            assert pull.lease_owner == ""
            on_p = p_models / "org--SmolLM2-135M-GGUF" / FILE
            assert on_p.stat().st_size == hub.blob(REPO, FILE).size
            assert hub.bytes_served(REPO, FILE) >= on_p.stat().st_size
            ModelConfig.objects.filter(name="pulled-p").update(node_labels=["zone-p"])
            cluster_setup.wait_resident("pulled-p", {"ep"})
            _, headers, body = cluster_setup.routed(
                cluster.nodes["a"], "pulled-p", cluster.key
            )
            assert headers["X-Roundhouse-Node"] == "p"
            assert body["choices"][0]["message"]["content"] is not None
        finally:
            cluster.remove_node("p")
            ModelConfig.objects.filter(name="pulled-p").delete()
            ModelPull.objects.filter(name="pulled-p").delete()
            # Placed on a or b for a moment before its labels were set, it may
            # have been copied into their (the checkout's) models directory.
            if not pulled_before:
                shutil.rmtree(smol / "org--SmolLM2-135M-GGUF", ignore_errors=True)
