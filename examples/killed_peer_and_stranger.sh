#!/usr/bin/env bash
# The swarm's failure promises, run as a user runs them: a keyed DiLoCo swarm of three `decentral train`
# processes on loopback; one is SIGKILLed after step 100 (mid-round); then a peer without the key tries
# to join. Prints the survivors' progress lines (cumulative wait per round) and what the stranger saw.
# Usage: examples/killed_peer_and_stranger.sh [OUT]   (about 2 minutes on 2 cores)
set -u
OUT=${1:-runs/killed-peer}
D=${DECENTRAL:-decentral}
rm -rf "$OUT"; mkdir -p "$OUT"
"$D" swarm keygen "$OUT/swarm.key" >/dev/null
common=(--protocol diloco --swarm-key "$OUT/swarm.key" --steps 300 --num-workers 3 --min-peers 3 --timeout 60)
"$D" train "${common[@]}" --out "$OUT/w0" --name w0 --worker-index 0 --maddr-file "$OUT/maddr" > "$OUT/w0.log" 2>&1 &
P0=$!
until [ -s "$OUT/maddr" ]; do sleep 0.5; done
JOIN=$(head -1 "$OUT/maddr")
"$D" train "${common[@]}" --out "$OUT/w1" --name w1 --worker-index 1 --join "$JOIN" > "$OUT/w1.log" 2>&1 &
P1=$!
"$D" train "${common[@]}" --out "$OUT/w2" --name w2 --worker-index 2 --join "$JOIN" > "$OUT/w2.log" 2>&1 &
P2=$!
until grep -q "step   100" "$OUT/w2.log" 2>/dev/null; do sleep 0.5; done
kill -9 "$P2"; echo "killed w2 after its step 100"
"$D" train --protocol diloco --steps 300 --out "$OUT/stranger" --name stranger --join "$JOIN" --min-peers 2 \
  > "$OUT/stranger.log" 2>&1 &
PS=$!
wait "$P0" "$P1"
kill "$PS" 2>/dev/null; wait "$PS" 2>/dev/null
echo "--- w0 (wait is cumulative)"; grep -E "step|done" "$OUT/w0.log"
echo "--- w1"; grep "done" "$OUT/w1.log"
echo "--- the stranger (no key)"; grep -v "^note:" "$OUT/stranger.log"
