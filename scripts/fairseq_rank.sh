#!/usr/bin/env bash
# Run one rank of a data-parallel fairseq command started by torchrun, on CPU or GPU.
#
#   torchrun --no-python --nproc_per_node 2 scripts/fairseq_rank.sh \
#       fairseq-train data-bin/x --cpu --distributed-backend gloo ...
#
# fairseq 0.12 only reads torchrun's environment when it already believes there is
# more than one device (it counts CUDA devices), so on CPU it would train two
# independent models. This wrapper hands the rendezvous over explicitly: torchrun's
# MASTER_ADDR/MASTER_PORT through env://, and the rank and world size it assigned.
set -euo pipefail
: "${RANK:?run this through torchrun (RANK is not set)}"
: "${WORLD_SIZE:?run this through torchrun (WORLD_SIZE is not set)}"
exec "$@" --distributed-init-method env:// --distributed-world-size "$WORLD_SIZE" \
    --distributed-rank "$RANK" --distributed-no-spawn
