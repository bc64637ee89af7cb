#!/usr/bin/env bash
# A newcomer joins a DiLoCo (or CO2) swarm whose state takes longer than swarm.timeout, and than a round, to download:
# two workers of a 19M-parameter GPT, our streams paced to 20 Mb/s by the application (netlab's loopback mode),
# timeout 30 s; a third joins after their step 50. Prints each worker's last lines. About 6 minutes on 2 cores.
# Usage: docs/benchmarks/slow_join.sh [OUT]   (DECENTRAL: the command to run, default `decentral`; PROTOCOL: the
# recipe, default diloco; STEPS: the run's length, default 480; EXTRA: more options for every worker, e.g.
# "--island-size 2 --island-mode sharded": each worker an island of 2 ranks)
set -u
OUT=${1:-runs/slow-join}
D=${DECENTRAL:-decentral}
export DECENTRAL_NETLAB_MODE=loopback DECENTRAL_LINK_RATE_BPS=20000000
S=(--protocol ${PROTOCOL:-diloco} --steps ${STEPS:-480} --timeout 30 --set every=24 --set model.n_layer=6 --set model.d_model=512
   --set model.n_head=8 --set train.batch_size=1 --set train.context=32 --set train.eval_batches=1 ${EXTRA:-})
rm -rf "$OUT"; mkdir -p "$OUT"
$D train "${S[@]}" --out "$OUT/w0" --maddr-file "$OUT/w0.maddr" --min-peers 2 > "$OUT/w0.log" 2>&1 &
P0=$!
until [ -s "$OUT/w0.maddr" ]; do sleep 0.5; done
JOIN=$(head -1 "$OUT/w0.maddr")
$D train "${S[@]}" --out "$OUT/w1" --join "$JOIN" --min-peers 2 > "$OUT/w1.log" 2>&1 &
P1=$!
until grep -qE "step +50 " "$OUT/w0.log"; do sleep 1; done
echo "the newcomer starts at $(date +%T)"
$D train "${S[@]}" --out "$OUT/w2" --join "$JOIN" > "$OUT/w2.log" 2>&1
echo "the newcomer exited with code $? at $(date +%T)"
wait "$P0" "$P1"
for w in w0 w1 w2; do echo "--- $w"; grep -vE "^note:|^\s*$" "$OUT/$w.log" | tail -8; done
