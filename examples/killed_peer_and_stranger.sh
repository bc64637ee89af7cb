#!/usr/bin/env bash
# The swarm's failure promises, run as a user runs them: a keyed DiLoCo swarm of three `decentral train`
# processes on loopback; one is SIGKILLed after step 100 (mid-round); then a peer without the key tries
# to join. Prints the survivors' progress lines (cumulative wait per round) and what the stranger saw.
# Usage: [PROTOCOL=diloco] examples/killed_peer_and_stranger.sh [OUT]   (about 2 minutes on 2 cores)
set -u
OUT=${1:-runs/killed-peer}
D=${DECENTRAL:-decentral}
source "$(dirname "$0")/keyed_diloco_swarm.sh"
start_keyed_swarm "$OUT"
kill -9 "$P2"; echo "killed w2 after its step 100"
"$D" train --protocol "${PROTOCOL:-diloco}" --steps 300 --out "$OUT/stranger" --name stranger --join "$JOIN" --min-peers 2 \
  > "$OUT/stranger.log" 2>&1 &
PS=$!
wait "$P0" "$P1"
kill "$PS" 2>/dev/null; wait "$PS" 2>/dev/null
echo "--- w0 (wait is cumulative)"; grep -E "step|done" "$OUT/w0.log"
echo "--- w1"; grep "done" "$OUT/w1.log"
echo "--- the stranger (no key)"; grep -v "^note:" "$OUT/stranger.log"
