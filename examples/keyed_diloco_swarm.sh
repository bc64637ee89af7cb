# Sourced by examples/killed_peer_and_stranger.sh and examples/frozen_peer.sh (needs D, the decentral command).
# start_keyed_swarm OUT: a fresh OUT with a swarm key, and three keyed DiLoCo (or $PROTOCOL) `decentral train`
# processes on loopback (300 steps, H = 50, the default 60 s sync timeout) logging to OUT/w0.log .. OUT/w2.log;
# their pids in P0 P1 P2, w0's address in JOIN. Returns once w2 has logged its step 100 (in the middle of round 3).
start_keyed_swarm() {
  local out=$1
  rm -rf "$out"; mkdir -p "$out"
  "$D" swarm keygen "$out/swarm.key" >/dev/null
  local common=(--protocol "${PROTOCOL:-diloco}" --swarm-key "$out/swarm.key" --steps 300 --num-workers 3 --min-peers 3 --timeout 60)
  "$D" train "${common[@]}" --out "$out/w0" --name w0 --worker-index 0 --maddr-file "$out/maddr" > "$out/w0.log" 2>&1 &
  P0=$!
  until [ -s "$out/maddr" ]; do sleep 0.5; done
  JOIN=$(head -1 "$out/maddr")
  "$D" train "${common[@]}" --out "$out/w1" --name w1 --worker-index 1 --join "$JOIN" > "$out/w1.log" 2>&1 &
  P1=$!
  "$D" train "${common[@]}" --out "$out/w2" --name w2 --worker-index 2 --join "$JOIN" > "$out/w2.log" 2>&1 &
  P2=$!
  until grep -q "step   100" "$out/w2.log" 2>/dev/null; do sleep 0.5; done
}
