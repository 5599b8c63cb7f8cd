"""tpp-fairseq-rank: one rank of a data-parallel fairseq command that torchrun starts.

    torchrun --no-python --nproc_per_node 2 tpp-fairseq-rank fairseq-train DATA --cpu ...

fairseq 0.12 reads torchrun's environment only where it counts more than one CUDA
device, so on CPUs, or with one visible GPU per process, each process would train a
model of its own. This runs the command (in this process) with the rendezvous
(``env://``: torchrun's MASTER_ADDR and MASTER_PORT), the rank and the world size that
torchrun assigned, given to fairseq as its options."""

import argparse
import os
import sys

from tpp_pipeline.errors import UserError, report

PROG = "tpp-fairseq-rank"


def rank_command(command, environ=os.environ):
    """``command`` with fairseq's options for the rank torchrun's ``environ`` names."""
    for name in ("RANK", "WORLD_SIZE"):
        if name not in environ:
            raise UserError(f"run this through torchrun ({name} is not set)")
    # (tpp-train takes fairseq's options after --; without one they would be its own)
    fairseq_options = os.path.basename(command[0]) in ("tpp-train", "train.sh")
    separator = ["--"] if fairseq_options and "--" not in command else []
    return [
        *command,
        *separator,
        "--distributed-init-method", "env://",
        "--distributed-world-size", environ["WORLD_SIZE"],
        "--distributed-rank", environ["RANK"],
        "--distributed-no-spawn",
    ]  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="a fairseq command and its options"
    )
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:  # (argparse keeps the separator in a remainder)
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the fairseq command to run, e.g. fairseq-train DATA ...")
    try:
        command = rank_command(args.command)
        os.execvp(command[0], command)
    except UserError as error:
        return report(PROG, error)
    except OSError as error:
        return report(PROG, UserError(f"cannot run {command[0]}: {error.strerror}"))


if __name__ == "__main__":
    sys.exit(main())
