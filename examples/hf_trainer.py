"""Train a tiny Llama with `transformers.Trainer` under DiLoCo: the Trainer stays as it is, one callback joins
it to the swarm (pip install 'decentral[hf]').

    python examples/hf_trainer.py --peers 2 --steps 40    # 2 peers in this process, over a real swarm on loopback

(Trainers in one process share accelerate's process-wide state: with gradient_accumulation_steps > 1, one
would skip real optimizer steps of the other. Run one peer per process then, as across machines.)

Across machines, one peer each (the first prints the address the others pass to --join):
    python examples/hf_trainer.py --host 0.0.0.0 --min-peers 2
    python examples/hf_trainer.py --host 0.0.0.0 --join /ip4/.../p2p/...
"""

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from decentral.data import eval_batches, load_corpus, train_batches
from decentral.integrations.hf_trainer import DecentralCallback
from decentral.swarm import SwarmTransport

parser = argparse.ArgumentParser()
parser.add_argument("--peers", type=int, default=1, help="peers this process runs")
parser.add_argument("--min-peers", type=int, help="peers to wait for before training (default: --peers)")
parser.add_argument("--join", action="append", default=[])
parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--every", type=int, default=10, help="inner steps per DiLoCo round")
parser.add_argument("--seed", type=int, default=0, help="data order of the first peer here; give each machine its own")
args = parser.parse_args()

CONTEXT = 64
corpus = load_corpus(max_bytes=1_000_000)  # the Python standard library's own source, one token per byte
val = eval_batches(corpus.val, batch_size=8, context=CONTEXT, num_batches=4)


class ByteWindows(torch.utils.data.IterableDataset):
    """Endless random windows of the training bytes; the causal LM shifts its labels itself."""

    def __init__(self, seed: int):
        self.seed = seed

    def __iter__(self):
        for x, _ in train_batches(corpus.train, batch_size=1, context=CONTEXT, seed=self.seed):
            yield {"input_ids": x[0], "labels": x[0]}


def val_loss(model) -> float:
    model.eval()
    with torch.no_grad():
        loss = sum(model(input_ids=x, labels=x).loss.item() for x, _ in val) / len(val)
    model.train()
    return loss


def make_peer(index: int, transport: SwarmTransport) -> tuple[Trainer, DecentralCallback]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=CONTEXT))
    training = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=8,
                                 learning_rate=3e-3, logging_steps=args.every, save_strategy="no", report_to="none",
                                 disable_tqdm=True, use_cpu=True)
    sync = DecentralCallback("diloco", transport, peers=args.min_peers or args.peers, every=args.every)  # ← the new line
    return Trainer(model=model, args=training, train_dataset=ByteWindows(args.seed + index), callbacks=[sync]), sync


def train(index: int, trainer: Trainer, sync: DecentralCallback) -> torch.nn.Module:
    before = val_loss(trainer.model)
    trainer.train()
    print(f"peer {index}: val loss {before:.3f} -> {val_loss(trainer.model):.3f}, {len(sync.adoption.reports)} DiLoCo "
          f"rounds, {sync.adoption.transport.bytes_sent / 2**20:.2f} MiB sent", flush=True)
    return trainer.model


torch.set_num_threads(1)
first = SwarmTransport("hf-trainer-example", args.join, host=args.host, timeout=30)
transports = [first] + [SwarmTransport("hf-trainer-example", first.multiaddrs(), timeout=30) for _ in range(args.peers - 1)]
print("others join with: --join", first.multiaddrs()[0], flush=True)
try:
    peers = [make_peer(i, t) for i, t in enumerate(transports)]  # here, not in the threads: torch's RNG is global
    with ThreadPoolExecutor(args.peers) as pool:
        models = list(pool.map(train, range(args.peers), *zip(*peers)))
    if len(models) > 1 and args.steps % args.every == 0:
        same = all(torch.equal(a, b) for m in models[1:] for a, b in zip(models[0].parameters(), m.parameters()))
        print(f"the peers' models are identical after the last round: {same}", flush=True)
finally:
    for transport in transports:
        transport.close()
