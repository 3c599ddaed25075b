"""One learner of the example: a plain PyTorch training loop. The lines marked ``# diloco``
are all that joins it to the others; without them it trains alone.

    python train.py --syncer 127.0.0.1:7000 --id site-a
"""

import argparse
import time
import zlib

import torch
from model import TARGET, build

import diloco  # diloco

parser = argparse.ArgumentParser()
parser.add_argument("--syncer", default="127.0.0.1:7000")
parser.add_argument("--id", default="site-a")
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--pause", type=float, default=0.005, help="seconds: a stand-in for compute")
args = parser.parse_args()
torch.set_num_threads(1)

model = build()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
learner = diloco.Learner(model, optimizer, syncer=args.syncer, learner_id=args.id)  # diloco
learner.wait_for_global(timeout=60)  # diloco: start from the global model, or raise
data = torch.Generator().manual_seed(zlib.crc32(args.id.encode()))  # each site its own data
for _ in range(args.steps):
    x = torch.randn(32, 16, generator=data)
    loss = ((model(x).squeeze(-1) - x @ TARGET) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    learner.step(tokens=len(x))  # diloco: never waits for the network
    time.sleep(args.pause)  # this model's step takes ~1 ms: a real one takes longer
learner.close()  # diloco: send what is left, leave the syncer
print(f"{args.id}: {args.steps} steps, last loss {loss.item():.4f}")
