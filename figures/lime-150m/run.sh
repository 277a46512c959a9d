#!/usr/bin/env bash
# The lime-150m study in one command, on one machine with GPUS GPUs (figures/lime-150m/README.md):
#   bash figures/lime-150m/run.sh /abs/path/to/DATA [GPUS]
# DATA holds fineweb-edu/train/ (training shards), fineweb-edu/test.jsonl (held-out documents) and
# blimp/. Every step is resumable: run the same command again after an interruption.
set -euo pipefail
DATA=$(cd "$1" && pwd)  # absolute: the recipe records the data path, and a resumed run must name the same
GPUS=${2:-8}
OUT=runs/lime-150m
TEST="$DATA/fineweb-edu/test.jsonl"

# 0. the data the protocol fixes, by name and hash (recorded at the first read), and the declaration it
# amends: nothing trains until the study declares the amendment's eleven secondary endpoints
bash "$(dirname "$0")/check_data.sh" "$DATA"
python -c "
import sys
from lime_probe.studies import STUDIES
n = sum(c.role == 'secondary' for c in STUDIES['lime-150m'].claims)
if n != 11:
    print(f'run.sh: the lime-150m declaration holds {n} secondary endpoints, the protocol 11', file=sys.stderr)
    sys.exit(2)
"

# 1. tokenise the training shards and the held-out documents once (the cache every process reads)
lime-model prepare --recipe lime-150m --data "$DATA/fineweb-edu/train" --eval-data "$TEST"

# 2. train every run, seed-major, each over all GPUs (DDP); a finished run is refused, so it is skipped
for seed in 0 1 2 3 4; do
  for model in "lime full" "llama none"; do
    set -- $model
    run="$OUT/train/$1-s$seed"
    if [ -f "$run/model.safetensors" ]; then continue; fi
    accelerate launch --multi_gpu --num_processes "$GPUS" "$(command -v lime-model)" train \
      --recipe lime-150m --data "$DATA/fineweb-edu/train" --eval-data "$TEST" --seed "$seed" \
      --routing "$2" --out "$run" --no-progress
  done
done

# 3. measure every run and compare (one GPU; reuses the finished runs above)
lime-probe reproduce --study lime-150m --data "$DATA" --out "$OUT" --device cuda --results figures/lime-150m
