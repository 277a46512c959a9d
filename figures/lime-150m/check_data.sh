#!/usr/bin/env bash
# The lime-150m data, fixed by name and hash (PROTOCOL.md, amendment A3):
#   bash figures/lime-150m/check_data.sh DATA          check DATA (run.sh's first step)
#   bash figures/lime-150m/check_data.sh --make-test SHARD DATA
#                                                     write DATA/fineweb-edu/test.jsonl from SHARD
# The check refuses a DATA/fineweb-edu/train/ that is not exactly the 14 fixed shards. At the first read
# it records the sha256 of every shard, of test.jsonl and of each BLiMP file in data.sha256 beside this
# script (commit it with the first results); afterwards any file that differs stops it. Exit 2 on a
# refusal, with one line saying why.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MANIFEST="$HERE/data.sha256"
N_SHARDS=14
TEST_SHARD=train-00233-of-00234.parquet
TEST_DOCUMENTS=5000

refuse() {
  echo "check_data.sh: $*" >&2
  exit 2
}

if [ "${1:-}" = "--make-test" ]; then
  [ $# -eq 3 ] || refuse "usage: check_data.sh --make-test SHARD DATA"
  [ "$(basename "$2")" = "$TEST_SHARD" ] || refuse "the held-out documents come from $TEST_SHARD, not $(basename "$2")"
  [ -f "$2" ] || refuse "no such file: $2"
  mkdir -p "$3/fineweb-edu"
  # written beside the target and renamed, so an interrupted run leaves no partial test.jsonl
  python - "$2" "$3/fineweb-edu/test.jsonl" "$TEST_DOCUMENTS" <<'EOF'
import json, os, sys
import pyarrow.parquet as pq

shard, target, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
texts = []
for batch in pq.ParquetFile(shard).iter_batches(columns=["text"]):
    texts += batch.column(0).to_pylist()[: n - len(texts)]
    if len(texts) == n:
        break
if len(texts) < n:
    sys.exit(f"check_data.sh: {shard} holds {len(texts)} documents, fewer than {n}")
tmp = f"{target}.{os.getpid()}.tmp"
with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
os.replace(tmp, target)
EOF
  exit 0
fi

[ $# -eq 1 ] || refuse "usage: check_data.sh DATA"
DATA=$1
[ -d "$DATA/fineweb-edu/train" ] || refuse "no folder $DATA/fineweb-edu/train"
expected=$(for i in $(seq 0 $((N_SHARDS - 1))); do printf 'train-%05d-of-00234.parquet\n' "$i"; done)
actual=$(ls -A "$DATA/fineweb-edu/train")
[ "$actual" = "$expected" ] ||
  refuse "$DATA/fineweb-edu/train must hold exactly train-00000-of-00234.parquet to train-$(printf %05d $((N_SHARDS - 1)))-of-00234.parquet"
[ -s "$DATA/fineweb-edu/test.jsonl" ] || refuse "no held-out documents at $DATA/fineweb-edu/test.jsonl"
compgen -G "$DATA/blimp/*.jsonl" >/dev/null || refuse "no BLiMP files in $DATA/blimp"

cd "$DATA"
if [ -f "$MANIFEST" ]; then
  failed=$(sha256sum --check --quiet "$MANIFEST" 2>/dev/null | cut -d: -f1 | paste -sd, -) || true
  [ -z "$failed" ] || refuse "$failed differ from $MANIFEST: not the data this study fixed"
  echo "check_data.sh: the data matches $MANIFEST"
else
  sha256sum fineweb-edu/train/* fineweb-edu/test.jsonl blimp/*.jsonl >"$MANIFEST.tmp"
  mv "$MANIFEST.tmp" "$MANIFEST"
  echo "check_data.sh: recorded the data's sha256 in $MANIFEST (commit it with the first results)"
fi
