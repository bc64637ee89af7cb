#!/usr/bin/env bash
# A DDP newcomer, as a user sees it: two `decentral train --protocol ddp` processes on loopback, members
# re-read every 100 steps; once the first has passed step 50, a third joins. It starts at the step after
# the one in which its donor named it, not at the next epoch boundary (step 100), and the three end
# bit-identical (one validation loss). Prints each worker's start line and its last line.
# Usage: examples/ddp_newcomer.sh [OUT]   (about 3 minutes on 2 cores)
set -u
OUT=${1:-runs/ddp-newcomer}
D=${DECENTRAL:-decentral}
rm -rf "$OUT"; mkdir -p "$OUT"
common=(--protocol ddp --set membership_every=100 --steps 200 --num-workers 3 --min-peers 2 --timeout 60)
"$D" train "${common[@]}" --out "$OUT/w0" --name w0 --worker-index 0 --maddr-file "$OUT/maddr" > "$OUT/w0.log" 2>&1 &
P0=$!
until [ -s "$OUT/maddr" ]; do sleep 0.5; done
JOIN=$(head -1 "$OUT/maddr")
"$D" train "${common[@]}" --out "$OUT/w1" --name w1 --worker-index 1 --join "$JOIN" > "$OUT/w1.log" 2>&1 &
P1=$!
until grep -qE "step +(5[0-9]|[6-9][0-9])\b" "$OUT/w0.log" 2>/dev/null; do sleep 0.5; done
echo "w0 passed step 50; starting w2"
"$D" train "${common[@]}" --out "$OUT/w2" --name w2 --worker-index 2 --join "$JOIN" > "$OUT/w2.log" 2>&1 &
P2=$!
wait "$P0" "$P1" "$P2"
for w in w0 w1 w2; do
  echo "--- $w"; grep -E "starts at|done" "$OUT/$w.log"
done
