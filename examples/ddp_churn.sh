#!/usr/bin/env bash
# DDP under churn, as a user sees it: `decentral train --protocol ddp` processes on loopback, members
# re-read every 100 steps (an epoch).
#   join: two workers; once the first has passed step 50, a third joins. It starts at the step after the
#         one in which its donor named it, not at the next epoch boundary (step 100).
#   kill: three workers; once the first has passed step 50, the third is SIGKILLed. The other two redo one
#         step's average without it and average as two from then on.
# The workers that end, end bit-identical (one validation loss). Prints each worker's start and last lines;
# per-step bytes and waits are in OUT/w*/metrics.jsonl.
# Usage: examples/ddp_churn.sh join|kill [OUT]   (about 1 minute on 2 cores)
set -u
MODE=${1:?usage: examples/ddp_churn.sh join|kill [OUT]}
OUT=${2:-runs/ddp-$MODE}
D=${DECENTRAL:-decentral}
rm -rf "$OUT"; mkdir -p "$OUT"
common=(--protocol ddp --set membership_every=100 --steps 200 --num-workers 3 --timeout 60)
worker() {  # worker INDEX EXTRA_ARGS...: start worker INDEX in the background
  local i=$1; shift
  "$D" train "${common[@]}" --out "$OUT/w$i" --name "w$i" --worker-index "$i" "$@" > "$OUT/w$i.log" 2>&1 &
}
past_step_50() {
  until [ "$(wc -l < "$OUT/w0/metrics.jsonl" 2>/dev/null || echo 0)" -gt 52 ]; do sleep 0.2; done
}
peers=$([ "$MODE" = join ] && echo 2 || echo 3)
worker 0 --min-peers "$peers" --maddr-file "$OUT/maddr"; P0=$!
until [ -s "$OUT/maddr" ]; do sleep 0.5; done
JOIN=$(head -1 "$OUT/maddr")
worker 1 --min-peers "$peers" --join "$JOIN"; P1=$!
if [ "$MODE" = join ]; then
  past_step_50; echo "w0 passed step 50; starting w2"
  worker 2 --min-peers "$peers" --join "$JOIN"; P2=$!
  wait "$P0" "$P1" "$P2"
else
  worker 2 --min-peers "$peers" --join "$JOIN"; P2=$!
  past_step_50; kill -9 "$P2"; wait "$P2" 2>/dev/null; echo "w0 passed step 50; killed w2"
  wait "$P0" "$P1"
fi
for w in w0 w1 w2; do
  echo "--- $w"; grep -E "starts at|done" "$OUT/$w.log"
done
