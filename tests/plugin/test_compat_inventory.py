"""docs/fairseq_notes.md lists every change that importing the plugin makes to fairseq,
torch and Python: the list is held equal to what an import really changes, found by
comparing every attribute of fairseq's modules and classes before and after the import
(in a fresh process, fairseq and its command-line modules imported first), by default and
with the checks and speed-ups chosen otherwise (the table says which variable chooses
each row; the corrections are always made)."""

import json
import re
import subprocess
import sys

import pytest
from support import REPO

PROBE = r"""
import atexit, json, logging, sys
import torch, torch.serialization
import fairseq, fairseq.checkpoint_utils, fairseq.trainer, fairseq.tasks
import fairseq.data.data_utils, fairseq.dataclass.utils, fairseq.optim.fp16_optimizer
import fairseq.sequence_scorer  # (imported by a generator built for --score-reference)
import fairseq_cli.train, fairseq_cli.generate, fairseq_cli.interactive, fairseq_cli.validate


def attributes():
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("fairseq", "torch")):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            found[f"{name}.{attr}"] = id(value)
            if isinstance(value, type) and value.__module__ == name:
                for inner, member in list(vars(value).items()):
                    found[f"{name}.{attr}.{inner}"] = id(member)
    return found


before = attributes()
hook, level = sys.excepthook, logging.getLogger().level
safe = len(torch.serialization.get_safe_globals())
cudnn = torch.backends.cuda.cudnn_sdp_enabled()
exits = atexit._ncallbacks()
import tpp_plugin  # noqa: E402

after = attributes()
changed = sorted(k for k in after if before.get(k) != after[k] and "tpp" not in k)
if len(torch.serialization.get_safe_globals()) > safe:
    changed.append("torch.serialization.add_safe_globals")
if cudnn and not torch.backends.cuda.cudnn_sdp_enabled():
    changed.append("torch.backends.cuda.enable_cudnn_sdp")
if sys.excepthook is not hook:
    changed.append("sys.excepthook")
if logging.getLogger().level != level:
    changed.append("logging.root.level")
if atexit._ncallbacks() > exits:
    changed.append("atexit.register")
print(json.dumps(changed))
"""


HEADER = "| changed | why | where it applies | chosen by |\n|---|---|---|---|\n"


def documented():
    """``{name: (variable, choice)}`` of the table's rows (``None``: always made)."""
    text = (REPO / "docs" / "fairseq_notes.md").read_text(encoding="utf-8")
    section = text.split("## Every change, and where it applies", 1)[1]
    assert f"\n\n{HEADER}" in section, "the table starts with its header, after a blank line"
    names = {}
    for row in section.split(HEADER, 1)[1].splitlines():
        if not row.startswith("| `"):
            break
        cells = row.strip("|").split(" | ")
        chosen = cells[-1].strip()
        switch = (
            None if chosen == "—" else tuple(re.fullmatch(r"`(\w+)`: `([\w-]+)`", chosen).groups())
        )
        for name in re.findall(r"`([^`]+)`", cells[0]):
            names[name] = switch
    return names


#: (TPP_FAIRSEQ_CHECKS, TPP_FAIRSEQ_SPEEDUPS) -> the choices they make (None: unset,
#: the defaults: the checks checkpoints, one-line-errors and data-files, the speed-ups
#: cudnn-off and flat-bf16)
SETTINGS = {
    (None, None): {"checkpoints", "one-line-errors", "data-files", "cudnn-off", "flat-bf16"},
    ("all", None): {
        "checkpoints",
        "record-every-task",
        "one-line-errors",
        "data-files",
        "cudnn-off",
        "flat-bf16",
    },
    ("data-files", "none"): {"data-files"},
    ("none", "none"): set(),
    ("checkpoints", "none"): {"checkpoints"},
    ("one-line-errors", "cudnn-off"): {"one-line-errors", "cudnn-off"},
    ("none", "flat-bf16"): {"flat-bf16"},
    ("none", "compiled-layers"): {"compiled-layers"},
    ("none", "multi-tensor-sync"): {"multi-tensor-sync"},
}


def test_every_check_and_speed_up_is_chosen_by_some_setting():
    """A check or speed-up that no setting above chooses would have its rows in the table
    unchecked (and a change it makes undocumented)."""
    import tpp_fairseq
    from tpp_fairseq import speed

    chosen = set().union(*SETTINGS.values())
    assert set(tpp_fairseq.CHECKS) | set(speed.SPEEDUPS) <= chosen, (
        set(tpp_fairseq.CHECKS) | set(speed.SPEEDUPS)
    ) - chosen


@pytest.mark.parametrize("checks, speedups", list(SETTINGS))
def test_the_documented_changes_are_the_changes_an_import_makes(checks, speedups):
    env = {"PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore", "LOGLEVEL": "INFO"}
    for variable, value in (("TPP_FAIRSEQ_CHECKS", checks), ("TPP_FAIRSEQ_SPEEDUPS", speedups)):
        if value is not None:
            env[variable] = value
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = set(json.loads(proc.stdout.splitlines()[-1]))
    # torch's private set behind add_safe_globals, and the modules fairseq's command
    # lines import the conversion into: one row each in the table
    changed.discard("torch._weights_only_unpickler._marked_safe_globals_set")
    copies = {
        c for c in changed if re.fullmatch(r"fairseq_cli\.\w+\.convert_namespace_to_omegaconf", c)
    }
    assert len(copies) == 4, changed
    changed = (changed - copies) | {"fairseq_cli.*.convert_namespace_to_omegaconf"}
    chosen = SETTINGS[(checks, speedups)]
    expected = {
        name for name, switch in documented().items() if switch is None or switch[1] in chosen
    }
    assert changed == expected, (
        f"changed but not in the table: {sorted(changed - expected)}; "
        f"in the table but not changed: {sorted(expected - changed)}"
    )


@pytest.mark.parametrize(
    "variable, message",
    [
        (
            "TPP_FAIRSEQ_CHECKS",
            "TPP_FAIRSEQ_CHECKS='records': unknown records; the checks are checkpoints, "
            "record-every-task, one-line-errors, data-files (or all, none)",
        ),
        (
            "TPP_FAIRSEQ_SPEEDUPS",
            "TPP_FAIRSEQ_SPEEDUPS='records': unknown records; the speed-ups are cudnn-off, "
            "flat-bf16, multi-tensor-sync, compiled-layers (or all, none)",
        ),
    ],
)
def test_an_unknown_switch_is_one_line_naming_the_variable_and_the_choices(variable, message):
    """Whichever checks it would have chosen (it had been a traceback from fairseq's import
    of the plugin), and before the plugin changes anything."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), variable: "records"}
    proc = subprocess.run(
        [sys.executable, "-m", "fairseq_cli.train", "--user-dir", str(REPO / "tpp_plugin")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode != 0
    assert f"fairseq-train: error: {message}\n" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_importing_tpp_fairseq_alone_changes_nothing():
    """The changes live in their own package, which the plugin applies: a program that
    imports it (to call one piece, such as ``allow_fairseq_checkpoints``) changes nothing."""
    probe = PROBE.replace("import tpp_plugin  # noqa: E402", "import tpp_fairseq  # noqa: E402")
    assert probe != PROBE
    env = {"PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore", "LOGLEVEL": "INFO"}
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_another_fairseq_than_the_changes_are_written_for_is_warned_about(monkeypatch, caplog):
    import fairseq

    import tpp_fairseq

    tpp_fairseq.check_fairseq_version()
    assert not caplog.records, "fairseq 0.12: no warning"
    monkeypatch.setattr(fairseq, "__version__", "0.13.0")
    tpp_fairseq.check_fairseq_version()
    assert "written for fairseq 0.12.x; this is fairseq 0.13.0" in caplog.text


def test_safe_loading_takes_numpy_numbers_and_refuses_object_arrays(tmp_path):
    """What fairseq checkpoints hold loads (numpy scalars and arrays of numbers, as
    --eval-bleu's counts); an array of Python objects is refused, as without the plugin
    (every numpy dtype was allow-listed, the object dtype's too)."""
    import pickle

    import numpy as np
    import torch

    from tpp_fairseq import allow_fairseq_checkpoints

    allow_fairseq_checkpoints()
    path = tmp_path / "state.pt"
    torch.save({"bleu": np.float64(3.5), "counts": np.array([1, 2], dtype=np.int64)}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["bleu"] == 3.5 and loaded["counts"].tolist() == [1, 2]
    torch.save({"objects": np.array(["a", 1], dtype=object)}, path)
    with pytest.raises(pickle.UnpicklingError, match="ObjectDType"):
        torch.load(path, weights_only=True)
