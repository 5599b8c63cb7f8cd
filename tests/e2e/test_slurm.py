"""The SLURM pipeline on a real (local, single-node) SLURM cluster.

scripts/slurm/local_cluster.sh installs slurm-wlm and munge when they are missing and
starts munged, slurmctld and slurmd with their state in a temporary folder; the test
submits the whole chain (prepare -> tag array -> binarize -> 2-task gloo training ->
averaging + evaluation) on a tiny corpus with scripts/slurm/submit.sh, polls the queue
until it drains, checks every job completed and the BLEU file exists, and stops the
daemons it started. The quality study (``tpp-study --launcher slurm``) runs there too:
every run a job, one of them requeued while it trains, the report the same as a local
study's.
"""

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import REPO, binarize_tagged, make_corpus, tool_env

import tpp_plugin  # noqa: F401  (allow-lists fairseq checkpoint contents for torch.load)

pytestmark = pytest.mark.slow  # jobs of a real SLURM cluster

SLURM = REPO / "scripts" / "slurm"
PIPELINE_TIMEOUT = 420  # seconds for the whole chain on a busy 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    install = subprocess.run(
        ["bash", str(SLURM / "local_cluster.sh"), "install"], capture_output=True, text=True
    )
    if install.returncode != 0:
        pytest.skip(f"SLURM packages cannot be installed here: {install.stderr.strip()}")
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(
        ["bash", str(SLURM / "local_cluster.sh"), "start", str(state), "4"],
        capture_output=True,
        text=True,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    env = tool_env()
    env["SLURM_CONF"] = str(state / "slurm.conf")
    env["TPP_VENV"] = sys.prefix  # the jobs use this interpreter's environment
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SLURM / "local_cluster.sh"), "stop", str(state)], check=False)


def test_a_cluster_folder_slurm_conf_cannot_hold_is_refused(cluster, tmp_path):
    """slurm.conf splits a path at spaces: the daemons did not start."""
    folder = tmp_path / "my cluster"
    started = subprocess.run(
        ["bash", str(SLURM / "local_cluster.sh"), "start", str(folder)],
        capture_output=True,
        text=True,
    )
    assert started.returncode == 1 and not folder.exists()
    assert f"'{folder}': SLURM's configuration cannot hold a path with spaces" in started.stderr


def job_states(env, job_id):
    """{job id (array tasks as id_index): state} from scontrol, which keeps finished jobs."""
    result = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
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
        queued = subprocess.run(
            ["squeue", "-h", "-o", "%i %T %r", "-j", ",".join(job_ids)],
            env=env,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if not queued:
            return
        # a dependency that can never be met means an earlier stage failed: stop waiting
        if "DependencyNeverSatisfied" in queued:
            return
        time.sleep(0.2)
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
    train_opts = (
        "--max-update 6 --save-interval-updates 1 --keep-interval-updates 10 "
        "--max-tokens 600 --update-freq 1 --warmup-updates 10 --log-interval 1"
    )
    env = dict(
        cluster, FAIRSEQ_EXTRA="--num-workers 0 --disable-validation", EVAL_OPTS="--max-tokens 2000"
    )
    command = [
        "bash",
        str(SLURM / "submit.sh"),
        "--cpu",
        "--preset",
        "tiny",
        "--tasks-per-node",
        "2",
        "--cpus-per-task",
        "1",
        "--shards",
        "2",
        "--n-avg",
        "2",
        "--time-train",
        "00:20:00",
        "--prepare-cmd",
        prepare,
        "--data-bin",
        str(tmp_path / "data-bin" / "tiny"),
        "--save-dir",
        str(tmp_path / "ckpt"),
        "--results-dir",
        str(tmp_path / "results"),
        "--reference",
        str(raw / "test.de"),
        "--train-opts",
        train_opts,
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    submitted = subprocess.run(command, env=env, capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    jobs = dict(line.split() for line in submitted.stdout.splitlines())
    assert list(jobs) == ["prepare", "tag", "binarize", "train", "evaluate"]
    assert all(re.fullmatch(r"\d+", job_id) for job_id in jobs.values()), jobs
    # the chain: each job depends (afterok) on the previous one
    for stage, before in [
        ("tag", "prepare"),
        ("binarize", "tag"),
        ("train", "binarize"),
        ("evaluate", "train"),
    ]:
        shown = subprocess.run(
            ["scontrol", "show", "job", jobs[stage]],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # SLURM clears a dependency once it is met
        done = set(job_states(env, jobs[before]).values()) == {"COMPLETED"}
        assert f"afterok:{jobs[before]}" in shown or (done and "Dependency=(null)" in shown), shown

    wait_for_queue_to_drain(env, list(jobs.values()), PIPELINE_TIMEOUT)
    logs = {
        path.name: path.read_text(errors="replace") for path in (tmp_path / "logs").glob("*.out")
    }
    states = {}
    for job_id in jobs.values():
        states.update(job_states(env, job_id))
    failed = {job: state for job, state in states.items() if state != "COMPLETED"}
    assert not failed, f"jobs not completed: {failed}\n" + "\n".join(
        f"===== {name}\n{text[-3000:]}" for name, text in sorted(logs.items())
    )
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
    averaged = (tmp_path / "ckpt" / "checkpoint_avg2.pt").read_bytes()

    # A failed evaluation of other checkpoints keeps the average that bleu.txt scored.
    by_update = sorted(
        (tmp_path / "ckpt").glob("checkpoint_*_*.pt"), key=lambda p: int(p.stem.split("_")[-1])
    )
    by_update[-1].unlink()  # the last two update checkpoints are now others
    # ... and so does one whose averaging fails (more checkpoints asked for than there are),
    # here on a copy of the save dir, so that the two evaluations run side by side
    other = tmp_path / "ckpt-other"
    shutil.copytree(tmp_path / "ckpt", other)
    failing = dict(env, EVAL_OPTS="--beam 0")
    again = subprocess.run(command + ["--from", "evaluate"], env=failing, capture_output=True)
    assert again.returncode == 0, again.stderr
    (job,) = [line.split()[1] for line in again.stdout.decode().splitlines()]
    into_the_same = dict(env, AVG_CHECKPOINT=str(other / "checkpoint_avg2.pt"))
    elsewhere = ["--save-dir", str(other), "--results-dir", str(tmp_path / "results-other")]
    averaging = subprocess.run(
        command + ["--from", "evaluate", "--n-avg", "50", *elsewhere],
        env=into_the_same,
        capture_output=True,
    )
    assert averaging.returncode == 0, averaging.stderr
    (averaging_job,) = [line.split()[1] for line in averaging.stdout.decode().splitlines()]
    wait_for_queue_to_drain(env, [job, averaging_job], PIPELINE_TIMEOUT)
    assert set(job_states(env, job).values()) == {"FAILED"}
    assert (tmp_path / "ckpt" / "checkpoint_avg2.pt").read_bytes() == averaged
    assert (tmp_path / "results" / "bleu.txt").read_text() == bleu
    assert not list((tmp_path / "ckpt").glob(".kept-*"))
    assert set(job_states(env, averaging_job).values()) == {"FAILED"}
    averaging_log = (tmp_path / "logs" / f"tpp-evaluate-{averaging_job}.out").read_text()
    assert "asked for the last 50 update checkpoints" in averaging_log, averaging_log[-3000:]
    assert (other / "checkpoint_avg2.pt").read_bytes() == averaged
    assert not list(other.glob(".kept-*")), "no second name left for the old one"


def sbatch(env, *options):
    """A stage script submitted as a user would, from the repository root, straight to
    sbatch: its job id."""
    return subprocess.run(
        ["sbatch", "--parsable", *options],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def submit_tag_task(env, task, log):
    """tag.sbatch submitted by hand, as an array of task ``task``."""
    return sbatch(
        env, f"--array={task}", "--cpus-per-task=1", f"--output={log}", "scripts/slurm/tag.sbatch"
    )


def test_a_tag_task_resubmitted_alone_needs_the_number_of_shards(cluster, tmp_path):
    """`sbatch --array=2 tag.sbatch` re-runs one task of a tagging: its array alone does
    not say how many shards there are (it tagged shard 2 of 1), so TAG_SHARDS must."""
    env = dict(cluster, TAG_CMD="echo tagging shard")
    jobs = {}
    for shards in (None, "4"):
        job_env = dict(env, TAG_SHARDS=shards) if shards else env
        log = tmp_path / f"tag-{shards}.out"
        jobs[log] = submit_tag_task(job_env, 2, log)
    wait_for_queue_to_drain(env, list(jobs.values()), 120)
    alone, given = jobs
    assert "set TAG_SHARDS to that number" in alone.read_text(), alone.read_text()
    assert set(job_states(env, jobs[alone]).values()) == {"FAILED"}
    assert "tagging shard 2/4" in given.read_text(), given.read_text()
    assert set(job_states(env, jobs[given]).values()) == {"COMPLETED"}


def test_dry_run_prints_chained_commands(tmp_path):
    """Without submitting: GPU resources, dependencies and the requeue-able training job."""
    result = subprocess.run(
        [
            "bash",
            str(SLURM / "submit.sh"),
            "--dry-run",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--partition",
            "gpu",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        env=tool_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 5
    assert "--dependency" not in lines[0]
    for line, before in zip(lines[1:], ["prepare", "tag", "binarize", "train"]):
        assert f"--dependency=afterok:\\<{before}\\> " in line, line
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
        [
            "bash",
            str(SLURM / "submit.sh"),
            "--dry-run",
            "--gpus-per-node",
            "2",
            "--tasks-per-node",
            "4",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        env=tool_env(),
        capture_output=True,
        text=True,
    )
    assert (
        result.returncode == 2
        and "--tasks-per-node 4" in result.stderr
        and "--gpus-per-node is 2" in result.stderr
    )
    assert not result.stdout


@pytest.mark.parametrize(
    "options, message",
    [
        (["--n-avg", "0"], "--n-avg must be a positive number, not '0'"),
        (["--nodes", "0"], "--nodes must be a positive number, not '0'"),
        (["--cpu", "--tasks-per-node", "0"], "--tasks-per-node must be a positive number"),
        (["--gpus-per-node", "x"], "--gpus-per-node must be a positive number, not 'x'"),
        (["--cpu", "--gpus-per-node", "4"], "--gpus-per-node 4 with --cpu (CPU_ONLY=1)"),
        (["--cpus-per-task", "-1"], "--cpus-per-task must be a positive number"),
        (["--preset"], "--preset needs a value"),
        (["--partition", "--cpu"], "--partition needs a value"),
        (["--bogus"], "unknown option '--bogus'"),
        (["--preset", "en_de"], "unknown preset 'en_de' (one of: en-de en-fr base cpu tiny)"),
        (["--time-train", "banana"], "--time-train 'banana' is not a SLURM time limit"),
        (["--time-tag", "1:2:3:4"], "--time-tag '1:2:3:4' is not a SLURM time limit"),
        (["--time-train", "2"], "--time-train 2: the training job is told 2 minutes before"),
        (["--time-train", "0-00:02"], "--time-train 0-00:02: the training job is told 2 minutes"),
        (["--from", "train", "--data-bin", "no/such"], "--from train: no data folder no/such"),
        (["--from", "evaluate", "--save-dir", "no/such"], "--from evaluate: no save dir no/such"),
    ],
)
def test_bad_resources_are_refused_before_submitting(options, message, tmp_path):
    """(--n-avg 0 was submitted, and the evaluation failed once training had run)"""
    command = ["bash", str(SLURM / "submit.sh"), "--dry-run", "--log-dir", str(tmp_path), *options]
    result = subprocess.run(command, env=tool_env(), capture_output=True, text=True)
    assert result.returncode == 2 and f"submit.sh: error: {message}" in result.stderr, result.stderr
    assert not result.stdout


def test_option_lists_are_split_as_a_command_line_and_nothing_in_them_expanded(tmp_path):
    """SBATCH_EXTRA, TRAIN_OPTS, FAIRSEQ_EXTRA and EVAL_OPTS were split at every space
    and their * matched against the job's folder: a path with spaces could not be given."""
    (tmp_path / "a.pt").write_text("")  # what a * matched
    value = "--restore-file 'runs/my run/x.pt' --keep *.pt $HOME \"a b\""
    words = subprocess.run(
        [
            "bash",
            "-c",
            'source "$0"; option_words w V; printf "%s\\n" "${w[@]}"',
            SLURM / "words.sh",
        ],
        env=dict(tool_env(), V=value),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert words.returncode == 0, words.stderr
    assert words.stdout.splitlines() == [
        "--restore-file",
        "runs/my run/x.pt",
        "--keep",
        "*.pt",
        "$HOME",
        "a b",
    ]
    command = ["bash", str(SLURM / "submit.sh"), "--dry-run", "--log-dir", str(tmp_path)]
    shown = subprocess.run(
        command,
        env=dict(tool_env(), SBATCH_EXTRA="--comment 'a b'"),
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    assert "--comment a b --job-name=tpp-prepare" in " ".join(
        shlex.split(shown.stdout.splitlines()[0])
    )
    for name in ("SBATCH_EXTRA", "TRAIN_OPTS", "FAIRSEQ_EXTRA", "EVAL_OPTS"):
        refused = subprocess.run(
            command, env=dict(tool_env(), **{name: "--x 'open"}), capture_output=True, text=True
        )
        assert refused.returncode == 2 and not refused.stdout, refused.stdout
        assert f"submit.sh: error: {name} cannot be split into options (a quote left open?)" in (
            refused.stderr
        )


@pytest.mark.parametrize("port", ["abc", "0", "65536", "29500x", "000000"])
def test_a_master_port_fairseq_would_refuse_is_refused_before_submitting(port, tmp_path):
    command = ["bash", str(SLURM / "submit.sh"), "--dry-run", "--log-dir", str(tmp_path)]
    result = subprocess.run(
        command, env=dict(tool_env(), MASTER_PORT=port), capture_output=True, text=True
    )
    assert result.returncode == 2 and (
        f"MASTER_PORT must be a TCP port (1-65535), not '{port}'" in result.stderr
    ), result.stderr
    assert not result.stdout
    result = subprocess.run(
        command, env=dict(tool_env(), MASTER_PORT="08080"), capture_output=True, text=True
    )
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 5, result.stderr


def test_cpu_only_is_0_or_1_and_every_slurm_time_format_is_taken(tmp_path):
    """CPU_ONLY=yes asked for GPUs (only "1" meant the CPU); SLURM's other time formats
    (minutes, days-hours) pass the check that refuses a time sbatch would refuse."""
    command = ["bash", str(SLURM / "submit.sh"), "--dry-run", "--log-dir", str(tmp_path / "logs")]
    env = dict(tool_env(), CPU_ONLY="yes")
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "CPU_ONLY must be 0 or 1 (--cpu sets 1), not 'yes'" in (
        result.stderr
    )
    times = ["--time-prepare", "90", "--time-tag", "2-12", "--time-train", "2-00:00:00"]
    times += ["--time-binarize", "30:00", "--time-evaluate", "Unlimited"]
    result = subprocess.run(command + times, env=tool_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--time=2-00:00:00" in result.stdout.splitlines()[3]
    assert not (tmp_path / "logs").exists(), "a dry run creates no log folder"
    # more than 2 minutes, or none (0: no limit, as sbatch reads it)
    for train in ("3", "2:01", "00:02:01", "0-00:03", "1-0", "infinite", "08", "0", "00:00:00"):
        result = subprocess.run(
            command + ["--time-train", train], env=tool_env(), capture_output=True, text=True
        )
        assert result.returncode == 0 and f"--time={train}" in result.stdout, (train, result.stderr)


def test_a_stage_sbatch_refuses_cancels_the_stages_submitted_before_it(cluster, tmp_path):
    """The chain is submitted whole or not at all: here the training job asks for GPUs
    the local cluster has none of, so sbatch refuses it after the data stages were
    submitted; those are cancelled (they would have run hours for nothing) and named."""
    env = dict(cluster, SBATCH_EXTRA="--hold")  # held: nothing runs even for a moment
    command = ["bash", str(SLURM / "submit.sh"), "--preset", "tiny", "--prepare-cmd", "true"]
    command += ["--reference", "ref.de", "--data-bin", str(tmp_path / "data"), "--from", "tag"]
    command += ["--to", "train", "--shards", "2", "--log-dir", str(tmp_path / "logs")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    submitted = dict(line.split() for line in result.stdout.splitlines())
    assert list(submitted) == ["tag", "binarize"], result.stdout
    assert "sbatch refused stage train (its message above); cancelled the stages submitted " in (
        result.stderr
    )
    assert f"tag {submitted['tag']},binarize {submitted['binarize']}" in result.stderr
    for job in submitted.values():
        assert set(job_states(cluster, job).values()) == {"CANCELLED"}, job_states(cluster, job)


def test_after_a_job_slurm_does_not_know_is_refused(cluster, tmp_path):
    """SLURM starts a job at once whose dependency names no job it knows: a mistyped
    --after would train on data still being written."""
    (tmp_path / "data").mkdir()
    command = ["bash", str(SLURM / "submit.sh"), "--cpu", "--preset", "tiny", "--from", "train"]
    command += ["--to", "train", "--data-bin", str(tmp_path / "data"), "--after", "987654"]
    result = subprocess.run(command, env=cluster, capture_output=True, text=True)
    assert result.returncode == 2 and "--after 987654: SLURM knows no job 987654" in result.stderr
    assert not result.stdout


@pytest.mark.parametrize("reference", [False, True], ids=["refused", "given"])
def test_a_preset_without_a_known_reference_needs_one_before_submitting(tmp_path, reference):
    """Only the WMT'14 presets find their data and test reference: a chain with another
    preset is refused before anything is submitted, not at its first data stage or at
    its end."""
    command = ["bash", str(SLURM / "submit.sh"), "--dry-run", "--preset", "base"]
    command += ["--data-bin", "data-bin/mine", "--log-dir", str(tmp_path / "logs")]
    no_data = subprocess.run(command, env=tool_env(), capture_output=True, text=True)
    assert no_data.returncode == 2 and "--prepare-cmd" in no_data.stderr, no_data.stderr
    assert not no_data.stdout
    own = dict(tool_env(), PREPARE_STAGE_CMD="prep", TAG_CMD="tag", BINARIZE_CMD="bin")
    with_own = subprocess.run(command + ["--to", "train"], env=own, capture_output=True)
    assert with_own.returncode == 0, with_own.stderr  # every data stage has its command
    command += ["--prepare-cmd", "tpp-prepare-corpus -s en -t de --name mine"]
    command += ["--reference", "raw/test.de"] if reference else []
    result = subprocess.run(command, env=tool_env(), capture_output=True, text=True)
    if reference:
        assert result.returncode == 0 and len(result.stdout.splitlines()) == 5
    else:
        assert result.returncode == 2 and "--reference FILE" in result.stderr
        assert not result.stdout
    to_train = subprocess.run(command + ["--to", "train"], env=tool_env(), capture_output=True)
    assert to_train.returncode == 0


def test_training_jobs_requeue_themselves_and_resume(cluster, tagged_data, tmp_path):
    """USR1 (what --signal=B:USR1@120 sends before the time limit) makes train.sbatch
    requeue its own job; the second run continues from checkpoint_last.pt, with one task
    and also with two data-parallel ranks (rank 0 loads it and sends it to rank 1). The
    two jobs run side by side."""
    jobs = {}
    for tasks in (1, 2):
        folder = tmp_path / f"tasks-{tasks}"
        folder.mkdir()
        env = dict(
            cluster,
            CPU_ONLY="1",
            PRESET="tiny",
            DATA_BIN=str(tagged_data["data"]),
            SAVE_DIR=str(folder / "ckpt"),
            TRAIN_OPTS="--arch transformer_tiny --task translation "
            "--criterion label_smoothed_cross_entropy --lr 5e-3 --warmup-updates 20 "
            "--max-tokens 400 --update-freq 1 --max-update 80 --save-interval-updates 20 "
            "--log-interval 20",
            FAIRSEQ_EXTRA="--num-workers 0 --disable-validation --save-interval 1000",
        )
        log = folder / "train.log"
        job = sbatch(
            env,
            f"--ntasks-per-node={tasks}",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            f"--output={log}",
            "scripts/slurm/train.sbatch",
        )
        jobs[tasks] = (job, log, folder / "ckpt")

    signalled = set()
    deadline = time.monotonic() + 180
    while len(signalled) < len(jobs):
        for tasks, (job, log, _) in jobs.items():
            if tasks in signalled:
                continue
            text = log.read_text() if log.exists() else ""
            if "Saved checkpoint" in text:
                subprocess.run(
                    ["scancel", "--batch", "--signal=USR1", job], env=cluster, check=True
                )
                signalled.add(tasks)
                continue
            assert time.monotonic() < deadline, f"no checkpoint written ({tasks} tasks):\n{text}"
            assert job_states(cluster, job)[job] in ("PENDING", "RUNNING"), text
        time.sleep(0.2)

    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    deadline = time.monotonic() + 240
    while not all(job_states(cluster, job)[job] in ended for job, _, _ in jobs.values()):
        assert time.monotonic() < deadline, "requeued jobs did not finish:\n" + "\n".join(
            log.read_text()[-3000:] for _, log, _ in jobs.values()
        )
        time.sleep(0.2)
    for tasks, (job, log, save_dir) in jobs.items():
        text = log.read_text()
        assert job_states(cluster, job)[job] == "COMPLETED", text[-3000:]
        assert "requeueing job" in text and "restart count 1" in text, text[-3000:]
        saved_before = [
            int(n) for n in re.findall(r"@ (\d+) updates", text.split("restart count 1")[0])
        ]
        loaded = re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)", text)
        assert loaded and int(loaded.group(1)) == max(saved_before) > 0, text[-3000:]
        shown = subprocess.run(
            ["scontrol", "show", "job", job],
            env=cluster,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "Restarts=1" in shown
        assert ("distributed init (rank 1)" in text) == (tasks == 2), text[-3000:]
        state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)
        assert state["optimizer_history"][-1]["num_updates"] == 80


# ----------------------------------------------------------------------------- tpp-study

# the tiny study of tools/test_study.py with one variant, the one with tags (two runs, the
# fewest a study takes: a job each, and the local study beside them, are the slow part),
# long enough (40 updates, a checkpoint every 10) for a job to be requeued while it
# trains; every epoch's batches grouped anew (what --config wmt14-big does), so that the
# resumed run trains on the batches of an uninterrupted one
STUDY = [
    "--config",
    "cpu",
    "--variants",
    "hybrid+tags",
    "--seeds",
    "1,2",
    "--device",
    "cpu",
    "--embed-dim",
    "32",
    "--ffn-dim",
    "64",
    "--heads",
    "4",
    "--layers",
    "2",
    "--max-tokens",
    "256",
    "--warmup-updates",
    "2",
    "--bootstrap-samples",
    "50",
    "--max-update",
    "40",
    "--save-interval-updates",
    "10",
    "--validate-interval-updates",
    "10",
]
FAIRSEQ_EXTRA = ["--", "--update-epoch-batch-itr", "True"]
STUDY_TIMEOUT = (
    600  # seconds for the jobs (and the local study beside them) on a busy 2-core machine
)


@pytest.fixture(scope="module")
def tagged_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("study_data")
    data = binarize_tagged(root / "text", root / "data-bin", n_train=120)
    return {"data": data, "reference": root / "text" / "test.tgt"}


def study_command(tagged_data, out, *options, study=STUDY, extra=FAIRSEQ_EXTRA):
    return [
        "tpp-study",
        *study,
        "--data",
        str(tagged_data["data"]),
        "--test-reference",
        str(tagged_data["reference"]),
        "--out",
        str(out),
        *options,
        *extra,
    ]


def report_tables(report: Path):
    """The report's table rows without their last cell, the measured training words/s."""
    return [
        line.rsplit("|", 2)[0] for line in report.read_text().splitlines() if line.startswith("|")
    ]


def test_study_runs_as_slurm_jobs_one_requeued_and_reports_as_a_local_study(
    cluster, tagged_data, tmp_path
):
    slurm_out, local_out = tmp_path / "slurm", tmp_path / "local"
    slurm_command = study_command(
        tagged_data, slurm_out, "--launcher", "slurm", "--time-limit", "30"
    )
    submitted = subprocess.run(
        slurm_command, env=cluster, capture_output=True, text=True, timeout=300
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    record = json.loads((slurm_out / "slurm" / "jobs.json").read_text())
    jobs = {entry["run"]: entry["job"] for entry in record["runs"].values()}
    folders = {entry["run"]: slurm_out / "runs" / name for name, entry in record["runs"].items()}
    assert sorted(jobs) == ["hybrid+tags-s1", "hybrid+tags-s2"]
    report_job = record["report"]["job"]
    dependency = re.search(
        r"Dependency=(\S+)",
        subprocess.run(
            ["scontrol", "show", "job", report_job], env=cluster, capture_output=True, text=True
        ).stdout,
    ).group(1)
    assert all(f"afterany:{job}" in dependency for job in jobs.values()), dependency

    # the same study as local processes, meanwhile
    local = subprocess.Popen(
        study_command(tagged_data, local_out, "--parallel", "2"),
        env=tool_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # requeued while it trains: once it has saved a checkpoint, before its last update
        victim, victim_job = folders["hybrid+tags-s1"], jobs["hybrid+tags-s1"]
        deadline = time.monotonic() + 300
        while not (victim / "checkpoints" / "checkpoint_last.pt").exists():
            assert time.monotonic() < deadline, "the job wrote no checkpoint"
            assert job_states(cluster, victim_job)[victim_job] in ("PENDING", "RUNNING")
            time.sleep(0.1)
        assert not (victim / "train.done").exists()
        subprocess.run(["scontrol", "requeue", victim_job], env=cluster, check=True)
        wait_for_queue_to_drain(cluster, [*jobs.values(), report_job], STUDY_TIMEOUT)
        local_output, _ = local.communicate(timeout=STUDY_TIMEOUT)
    finally:
        if local.poll() is None:
            local.kill()
    assert local.returncode == 0, local_output[-4000:]

    logs = {
        path.name: path.read_text(errors="replace")
        for path in (slurm_out / "slurm").glob("*_log.out")
    }
    states = {job: job_states(cluster, job)[job] for job in [*jobs.values(), report_job]}
    assert set(states.values()) == {"COMPLETED"}, f"{states}\n" + "\n".join(
        f"===== {name}\n{text[-3000:]}" for name, text in sorted(logs.items())
    )
    shown = subprocess.run(
        ["scontrol", "show", "job", victim_job],
        env=cluster,
        capture_output=True,
        text=True,
    ).stdout
    assert "Restarts=1" in shown
    victim_log = logs[f"{victim_job}_0_log.out"]
    assert "restart count 0" in victim_log and "restart count 1" in victim_log, victim_log[-3000:]
    # the job started again resumed from the checkpoint it had saved, and trained to the end
    loaded = re.findall(
        r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)", (victim / "run.log").read_text()
    )
    assert loaded and 0 < int(loaded[-1]) < 40, loaded
    assert (victim / "train.done").read_text().startswith("40 updates")

    # the report, written by the report job, is the local study's: same runs, same scores
    assert (slurm_out / "report.md").exists(), logs[f"{report_job}_0_log.out"][-3000:]
    assert "Device: SLURM jobs, CPU (1 per run)" in (slurm_out / "report.md").read_text()
    assert "DEBUG" not in logs[f"{report_job}_0_log.out"], "(matplotlib's, hundreds of lines)"
    assert sorted(p.name for p in (slurm_out / "runs").iterdir()) == sorted(
        p.name for p in (local_out / "runs").iterdir()
    )
    tables = report_tables(slurm_out / "report.md")
    assert len(tables) == 3 and tables == report_tables(local_out / "report.md")

    # the report command the submission printed, run as printed: a report, no new job
    hint = re.search(r"The report of what has finished, at any time: (.+)", submitted.stdout)
    before = (slurm_out / "slurm" / "jobs.json").read_text()
    reported = subprocess.run(
        shlex.split(hint.group(1)), env=cluster, capture_output=True, text=True, timeout=300
    )
    assert reported.returncode == 0, reported.stdout + reported.stderr
    assert "report of 2 finished run(s) of 2" in reported.stdout, reported.stdout[-3000:]
    assert (slurm_out / "slurm" / "jobs.json").read_text() == before

    # submitted again: every run is finished, nothing is trained again; a new report job
    stamps = {p: p.stat().st_mtime_ns for p in (slurm_out / "runs").glob("*/eval/bleu.txt")}
    again = subprocess.run(slurm_command, env=cluster, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count(": finished (") == 2, again.stdout
    record_again = json.loads((slurm_out / "slurm" / "jobs.json").read_text())
    assert record_again["runs"] == record["runs"] and record_again["report"]["after"] == []
    wait_for_queue_to_drain(cluster, [record_again["report"]["job"]], 120)
    assert job_states(cluster, record_again["report"]["job"]) == {
        record_again["report"]["job"]: "COMPLETED"
    }
    assert report_tables(slurm_out / "report.md") == tables
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps

    # a third study given the local one's records: no run is trained, the report is the same
    archive, imported = tmp_path / "records.tar.gz", tmp_path / "imported"
    packed = subprocess.run(
        study_command(tagged_data, local_out, "--report-only", "--pack", str(archive)),
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert packed.returncode == 0, packed.stdout + packed.stderr
    command = study_command(tagged_data, imported, "--launcher", "slurm", "--records", str(archive))
    submitted = subprocess.run(command, env=cluster, capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert submitted.stdout.count(": finished (") == 2, submitted.stdout
    record = json.loads((imported / "slurm" / "jobs.json").read_text())
    assert record["runs"] == {} and record["report"]["after"] == []
    wait_for_queue_to_drain(cluster, [record["report"]["job"]], 120)
    assert report_tables(imported / "report.md") == tables


def test_study_jobs_that_fail_are_named_with_their_logs_and_how_to_resume(
    cluster, tagged_data, tmp_path
):
    """A partition the cluster does not have is refused before anything is submitted;
    the jobs of runs that fail say why first, and the report job names them (two runs
    here), with their logs and the command that resumes them."""
    out = tmp_path / "study"
    tiny = [
        *STUDY[: STUDY.index("--max-update")],
        "--max-update",
        "2",
        "--variants",
        "control",
    ]

    # an unknown partition: an error before anything is submitted
    refused = subprocess.run(
        study_command(tagged_data, out, "--launcher", "slurm", "--partition", "nosuch", study=tiny),
        env=cluster,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2
    assert "--partition nosuch: no such partition on this cluster (it has debug)" in refused.stderr
    assert not (out / "slurm").exists() and not (out / "runs").exists()

    # every run's job fails (fairseq-train finds no model to fine-tune, which it checks only
    # as it trains): the report job says which, where their logs are and how to resume
    command = study_command(
        tagged_data,
        out,
        "--launcher",
        "slurm",
        "--time-limit",
        "10",
        study=tiny,
        extra=["--", "--finetune-from-model", "no-such-model.pt"],
    )
    submitted = subprocess.run(command, env=cluster, capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    record = json.loads((out / "slurm" / "jobs.json").read_text())
    jobs = {entry["run"]: entry["job"] for entry in record["runs"].values()}
    report_job = record["report"]["job"]
    wait_for_queue_to_drain(cluster, [*jobs.values(), report_job], 300)
    states = {job: job_states(cluster, job)[job] for job in [*jobs.values(), report_job]}
    assert set(states.values()) == {"FAILED"}, states
    run_log = (out / "slurm" / f"{jobs['control-s2']}_0_log.out").read_text(errors="replace")
    folder = next(
        out / "runs" / name for name, e in record["runs"].items() if e["run"] == "control-s2"
    )
    assert (
        "control-s2 failed: command failed" in run_log
        and "--finetune-from-model no-such-model.pt does not exist" in run_log
    ), run_log[-3000:]
    # the reason first, then submitit's traceback
    assert run_log.index("FAILED: control-s2 failed") < run_log.index("Traceback"), run_log[-3000:]
    assert f"run log: {folder / 'run.log'}" in run_log
    assert f"job log: {out / 'slurm' / (jobs['control-s2'] + '_0_log.out')}" in run_log
    report_log = (out / "slurm" / f"{report_job}_0_log.out").read_text(errors="replace")
    assert len(jobs) == 2 and "2 of 2 runs did not finish" in report_log, report_log[-3000:]
    assert report_log.index("FAILED: 2 of 2") < report_log.index("Traceback"), report_log[-3000:]
    for run, job in jobs.items():
        assert re.search(
            rf"{re.escape(run)}: job {job} \(FAILED\), job log \S+{job}_0_log.out, run log ",
            report_log,
        )
    assert "to resume, submit the study again with the same command" in report_log
    assert "no-such-model.pt" in report_log.split("to resume")[-1]  # the command, as given


def test_a_slurm_study_submits_the_runs_only_names_and_none_twice(cluster, tagged_data, tmp_path):
    """--only names the runs submitted (every planned run was submitted, whatever --only
    said); --status names each run's job and what SLURM says of it. The same command again
    while the run's job waits: no run is submitted twice, and the earlier report job
    (which waits for the earlier jobs only) is cancelled for a new one."""
    out = tmp_path / "study"
    tiny = [*STUDY[: STUDY.index("--max-update")], "--max-update", "2", "--variants", "transformer"]
    later = ("--launcher", "slurm", "--sbatch-option", "begin=now+600")  # (kept pending)
    command = study_command(tagged_data, out, *later, "--only", "transformer-s2", study=tiny)
    reports, records = [], []
    try:
        done = subprocess.run(command, env=cluster, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        records.append(json.loads((out / "slurm" / "jobs.json").read_text()))
        reports.append(records[0]["report"]["job"])
        runs = {entry["run"]: entry["job"] for entry in records[0]["runs"].values()}
        assert list(runs) == ["transformer-s2"] and records[0]["report"]["after"] == list(
            runs.values()
        )

        status = subprocess.run(
            study_command(
                tagged_data, out, *later, "--only", "transformer-s2", "--status", study=tiny
            ),
            env=cluster,
            capture_output=True,
            text=True,
            timeout=300,
        )
        job = runs["transformer-s2"]
        assert f"| transformer-s2 | not started (job {job} PENDING) |" in status.stdout, (
            status.stdout + status.stderr
        )

        done = subprocess.run(command, env=cluster, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        records.append(json.loads((out / "slurm" / "jobs.json").read_text()))
        reports.append(records[1]["report"]["job"])
        assert "not submitted again" in done.stdout and "is cancelled" in done.stdout, done.stdout
        assert records[1]["runs"] == records[0]["runs"] and reports[0] != reports[1]
        assert records[1]["report"]["after"] == [job]
        assert job_states(cluster, reports[0])[reports[0]] == "CANCELLED"
        assert job_states(cluster, reports[1])[reports[1]] == "PENDING"
    finally:
        queued = [job for record in records for job in record["runs"].values()]
        subprocess.run(
            ["scancel", *reports, *(entry["job"] for entry in queued)],
            env=cluster,
            capture_output=True,
        )


def test_a_dry_run_checks_the_partition_on_the_cluster(cluster, tagged_data, tmp_path):
    """The dry run shows the job before anything is submitted, and a partition the
    cluster does not have is refused there already, naming the ones it has."""
    planned = subprocess.run(
        study_command(tagged_data, tmp_path / "out", "--launcher", "slurm", "--dry-run"),
        env=cluster,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert planned.returncode == 0, planned.stderr
    assert "#SBATCH --requeue" in planned.stdout and "not checked" not in planned.stdout
    wrong = subprocess.run(
        study_command(
            tagged_data,
            tmp_path / "out",
            "--launcher",
            "slurm",
            "--partition",
            "nosuch",
            "--dry-run",
        ),
        env=cluster,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr
    assert "--partition nosuch: no such partition on this cluster (it has " in wrong.stderr
    assert not (tmp_path / "out" / "slurm").exists(), "nothing submitted"


def test_a_tpp_venv_without_python_stops_the_job(cluster, tmp_path):
    """A mistyped TPP_VENV was skipped: the job then ran whatever was on PATH and failed
    later, naming a command, not the variable."""
    log = tmp_path / "tag.out"
    env = dict(cluster, TPP_VENV=str(tmp_path / "no-venv"), TAG_CMD="echo tagging shard")
    job = submit_tag_task(env, 0, log)
    wait_for_queue_to_drain(cluster, [job], 120)
    assert f"error: TPP_VENV='{tmp_path / 'no-venv'}' is not an environment" in log.read_text()
    assert "tagging shard" not in log.read_text()
    assert set(job_states(cluster, job).values()) == {"FAILED"}


def test_the_study_reads_the_queue_whatever_squeue_settings_the_user_has(cluster, tmp_path):
    """Which of a study's jobs are still queued decides what is submitted again. With
    ``SQUEUE_STATES=all`` an ended job was read as queued (its run never resubmitted),
    with ``SQUEUE_PARTITION`` of another partition a waiting one as ended (its run
    trained twice at once)."""
    ended = sbatch(cluster, f"--output={tmp_path}/ended.out", "--wrap", "true")
    waiting = sbatch(cluster, "--begin=now+600", f"--output={tmp_path}/w.out", "--wrap", "true")
    try:
        wait_for_queue_to_drain(cluster, [ended], 120)
        env = dict(cluster, SQUEUE_STATES="all", SQUEUE_PARTITION="nosuch")
        read = subprocess.run(
            [
                sys.executable,
                "-c",
                "import json, sys; from tpp_tools.study.slurm import queue_states; "
                "print(json.dumps(queue_states(sys.argv[1:])))",
                ended,
                waiting,
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(read.stdout) == {waiting: "PENDING"}, read.stdout + read.stderr
    finally:
        subprocess.run(["scancel", waiting], env=cluster, capture_output=True)
