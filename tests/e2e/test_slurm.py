"""The SLURM pipeline on a real (local, single-node) SLURM cluster.

scripts/slurm/local_cluster.sh installs slurm-wlm and munge when they are missing and
starts munged, slurmctld and slurmd with their state in a temporary folder; the test
submits the whole chain (prepare -> tag array -> binarize -> 2-task gloo training ->
averaging + evaluation) on a tiny corpus with scripts/slurm/submit.sh, polls the queue
until it drains, checks every job completed and the BLEU file exists, and stops the
daemons it started.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import REPO, make_corpus, tool_env

import tpp_plugin  # noqa: F401  (allow-lists fairseq checkpoint contents for torch.load)

SLURM = REPO / "scripts" / "slurm"
PIPELINE_TIMEOUT = 420  # seconds for the whole chain on a busy 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    install = subprocess.run(["bash", str(SLURM / "local_cluster.sh"), "install"],
                             capture_output=True, text=True)
    if install.returncode != 0:
        pytest.skip(f"SLURM packages cannot be installed here: {install.stderr.strip()}")
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(SLURM / "local_cluster.sh"), "start", str(state), "4"],
                             capture_output=True, text=True)
    assert started.returncode == 0, started.stdout + started.stderr
    env = tool_env()
    env["SLURM_CONF"] = str(state / "slurm.conf")
    env["TPP_VENV"] = sys.prefix  # the jobs use this interpreter's environment
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SLURM / "local_cluster.sh"), "stop", str(state)], check=False)


def job_states(env, job_id):
    """{job id (array tasks as id_index): state} from scontrol, which keeps finished jobs."""
    result = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env,
                            capture_output=True, text=True, check=True)
    states = {}
    for line in result.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        name = fields["JobId"]
        if fields.get("ArrayTaskId"):
            name = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}"
        states[name] = fields["JobState"]
    return states


def wait_for_queue_to_drain(env, job_ids, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-o", "%i %T %r", "-j", ",".join(job_ids)],
                                env=env, capture_output=True, text=True).stdout.strip()
        if not queued:
            return
        # a dependency that can never be met means an earlier stage failed: stop waiting
        if "DependencyNeverSatisfied" in queued:
            return
        time.sleep(1)
    raise AssertionError(f"the pipeline did not finish within {timeout}s")


def test_chained_pipeline_runs_on_slurm(cluster, tmp_path):
    corpus = make_corpus(tmp_path / "corpus", sizes=(160, 20, 20))
    raw = corpus / "raw"
    prepare = (
        f"tpp-prepare-corpus -s en -t de --trainpref {raw}/train "
        f"--validpref {raw}/valid --testpref {raw}/test --name tiny "
        f"--work-dir {tmp_path}/work --data-bin {tmp_path}/data-bin --bpe-merges 200"
    )
    # a checkpoint every update (see tools/test_evaluate.py for why), the last two averaged
    train_opts = ("--max-update 6 --save-interval-updates 1 --keep-interval-updates 10 "
                  "--max-tokens 600 --update-freq 1 --warmup-updates 10 --log-interval 1")
    env = dict(cluster, FAIRSEQ_EXTRA="--num-workers 0 --disable-validation",
               EVAL_OPTS="--max-tokens 2000")
    command = [
        "bash", str(SLURM / "submit.sh"), "--cpu", "--preset", "tiny",
        "--tasks-per-node", "2", "--cpus-per-task", "1", "--shards", "2", "--n-avg", "2",
        "--time-train", "00:20:00", "--prepare-cmd", prepare,
        "--data-bin", str(tmp_path / "data-bin" / "tiny"), "--save-dir", str(tmp_path / "ckpt"),
        "--results-dir", str(tmp_path / "results"), "--reference", str(raw / "test.de"),
        "--train-opts", train_opts, "--log-dir", str(tmp_path / "logs"),
    ]
    submitted = subprocess.run(command, env=env, capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    jobs = dict(line.split() for line in submitted.stdout.splitlines())
    assert list(jobs) == ["prepare", "tag", "binarize", "train", "evaluate"]
    assert all(re.fullmatch(r"\d+", job_id) for job_id in jobs.values()), jobs
    # the chain: each job depends (afterok) on the previous one
    for stage, before in [("tag", "prepare"), ("binarize", "tag"), ("train", "binarize"),
                          ("evaluate", "train")]:
        shown = subprocess.run(["scontrol", "show", "job", jobs[stage]], env=env,
                               capture_output=True, text=True, check=True).stdout
        assert f"afterok:{jobs[before]}" in shown or "Dependency=(null)" in shown, shown

    wait_for_queue_to_drain(env, list(jobs.values()), PIPELINE_TIMEOUT)
    logs = {path.name: path.read_text(errors="replace") for path in (tmp_path / "logs").glob("*.out")}
    states = {}
    for job_id in jobs.values():
        states.update(job_states(env, job_id))
    failed = {job: state for job, state in states.items() if state != "COMPLETED"}
    assert not failed, f"jobs not completed: {failed}\n" + "\n".join(
        f"===== {name}\n{text[-3000:]}" for name, text in sorted(logs.items()))
    assert f"{jobs['tag']}_0" in states and f"{jobs['tag']}_1" in states  # two shards ran

    # training ran as 2 ranks through fairseq's SLURM initialisation, with the tag losses
    train_log = logs[f"tpp-train-{jobs['train']}.out"]
    assert "distributed init (rank 1)" in train_log, train_log[-3000:]
    assert "pos_loss" in train_log
    assert "--distributed-backend gloo" in train_log
    assert "training on 2 devices" in train_log  # one model on 2 ranks, not 2 separate runs
    bleu = (tmp_path / "results" / "bleu.txt").read_text()
    assert re.search(r"^sacrebleu_detok: \d+\.\d\d$", bleu, re.M), bleu
    assert re.search(r"^bleu_tok_compound_split: \d+\.\d\d$", bleu, re.M), bleu
    assert (tmp_path / "ckpt" / "checkpoint_avg2.pt").exists()


def test_dry_run_prints_chained_commands(tmp_path):
    """Without submitting: GPU resources, dependencies and the requeue-able training job."""
    result = subprocess.run(
        ["bash", str(SLURM / "submit.sh"), "--dry-run", "--nodes", "2", "--gpus-per-node", "8",
         "--partition", "gpu", "--log-dir", str(tmp_path / "logs")],
        env=tool_env(), capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert len(lines) == 5
    train = lines[3]
    assert "--nodes=2" in train and "--ntasks-per-node=8" in train and "--gpus-per-node=8" in train
    assert "--partition gpu" in train and "--dependency=afterok:\\<binarize\\>" in train
    assert "--array=0-7" in lines[1]
    header = (SLURM / "train.sbatch").read_text()
    assert "#SBATCH --requeue" in header and "#SBATCH --signal=B:USR1@120" in header
    assert "scontrol requeue" in header


def test_more_training_tasks_than_gpus_is_refused_before_submitting(tmp_path):
    """fairseq puts each task on GPU number SLURM_LOCALID: a task without one would fail
    on every node once the job starts."""
    result = subprocess.run(
        ["bash", str(SLURM / "submit.sh"), "--dry-run", "--gpus-per-node", "2", "--tasks-per-node", "4",
         "--log-dir", str(tmp_path / "logs")], env=tool_env(), capture_output=True, text=True)
    assert result.returncode == 2 and "--tasks-per-node 4" in result.stderr and "--gpus-per-node is 2" in result.stderr
    assert not result.stdout


def test_training_job_requeues_itself_and_resumes(cluster, nmt_corpus, tmp_path):
    """USR1 (what --signal=B:USR1@120 sends before the time limit) makes train.sbatch
    requeue its own job; the second run continues from checkpoint_last.pt."""
    data = nmt_corpus["data"]
    save_dir = tmp_path / "ckpt"
    log = tmp_path / "train.log"
    env = dict(
        cluster, CPU_ONLY="1", PRESET="tiny", DATA_BIN=str(data), SAVE_DIR=str(save_dir),
        TRAIN_OPTS="--arch transformer_tiny --task translation --criterion label_smoothed_cross_entropy "
                   "--lr 5e-3 --warmup-updates 20 --max-tokens 400 --update-freq 1 --max-update 300 "
                   "--save-interval-updates 20 --log-interval 20",
        FAIRSEQ_EXTRA="--num-workers 0 --disable-validation --save-interval 1000",
    )
    # submitted as a user would, from the repository root, straight to sbatch
    job = subprocess.run(["sbatch", "--parsable", "--ntasks-per-node=1", "--gpus-per-node=0",
                          "--cpus-per-task=1", f"--output={log}", "scripts/slurm/train.sbatch"],
                         cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()
    deadline = time.monotonic() + 180
    while not (log.exists() and "Saved checkpoint" in log.read_text()):
        assert time.monotonic() < deadline, "no checkpoint written:\n" + (log.read_text() if log.exists() else "")
        assert job_states(env, job)[job] in ("PENDING", "RUNNING"), log.read_text()
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)

    deadline = time.monotonic() + 240
    while job_states(env, job)[job] not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() < deadline, "requeued job did not finish:\n" + log.read_text()
        time.sleep(1)
    text = log.read_text()
    assert job_states(env, job)[job] == "COMPLETED", text[-3000:]
    assert "requeueing job" in text and "restart count 1" in text, text[-3000:]
    saved_before = [int(n) for n in re.findall(r"@ (\d+) updates", text.split("restart count 1")[0])]
    loaded = re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)", text)
    assert loaded and int(loaded.group(1)) == max(saved_before) > 0, text[-3000:]
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                           text=True, check=True).stdout
    assert "Restarts=1" in shown
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 300
